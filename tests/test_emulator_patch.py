"""Patch semantics on plain JSON values: RFC 7386 merge patch, RFC 6902 JSON patch (the RFCs' own
examples) and Kubernetes strategic merge as it applies to Nodes."""

from __future__ import annotations

import copy

import pytest

from kube_emulator.kinds import NODES
from kube_emulator.patch import (PRIMITIVE, PatchError, UnsupportedPatchType, apply_patch, json_equal, json_patch,
                                 merge_patch, parse_pointer, strategic_merge_patch)

# --- RFC 7386, appendix A ---------------------------------------------------------------------------

RFC7386_EXAMPLES = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize("target,patch,expected", RFC7386_EXAMPLES)
def test_merge_patch_rfc7386_examples(target, patch, expected):
    before = copy.deepcopy(target)
    assert merge_patch(target, patch) == expected
    assert target == before


def test_merge_patch_rfc7386_section3_example():
    target = {"title": "Goodbye!", "author": {"givenName": "John", "familyName": "Doe"},
              "tags": ["example", "sample"], "content": "This will be unchanged"}
    patch = {"title": "Hello!", "phoneNumber": "+01-123-456-7890", "author": {"familyName": None},
             "tags": ["example"]}
    assert merge_patch(target, patch) == {
        "title": "Hello!", "author": {"givenName": "John"}, "tags": ["example"],
        "content": "This will be unchanged", "phoneNumber": "+01-123-456-7890"}


# --- RFC 6902, appendix A ---------------------------------------------------------------------------

RFC6902_EXAMPLES = [
    ("A.1 add object member", {"foo": "bar"}, [{"op": "add", "path": "/baz", "value": "qux"}],
     {"baz": "qux", "foo": "bar"}),
    ("A.2 add array element", {"foo": ["bar", "baz"]}, [{"op": "add", "path": "/foo/1", "value": "qux"}],
     {"foo": ["bar", "qux", "baz"]}),
    ("A.3 remove object member", {"baz": "qux", "foo": "bar"}, [{"op": "remove", "path": "/baz"}], {"foo": "bar"}),
    ("A.4 remove array element", {"foo": ["bar", "qux", "baz"]}, [{"op": "remove", "path": "/foo/1"}],
     {"foo": ["bar", "baz"]}),
    ("A.5 replace", {"baz": "qux", "foo": "bar"}, [{"op": "replace", "path": "/baz", "value": "boo"}],
     {"baz": "boo", "foo": "bar"}),
    ("A.6 move value", {"foo": {"bar": "baz", "waldo": "fred"}, "qux": {"corge": "grault"}},
     [{"op": "move", "from": "/foo/waldo", "path": "/qux/thud"}],
     {"foo": {"bar": "baz"}, "qux": {"corge": "grault", "thud": "fred"}}),
    ("A.7 move array element", {"foo": ["all", "grass", "cows", "eat"]},
     [{"op": "move", "from": "/foo/1", "path": "/foo/3"}], {"foo": ["all", "cows", "eat", "grass"]}),
    ("A.8 test success", {"baz": "qux", "foo": ["a", 2, "c"]},
     [{"op": "test", "path": "/baz", "value": "qux"}, {"op": "test", "path": "/foo/1", "value": 2}],
     {"baz": "qux", "foo": ["a", 2, "c"]}),
    ("A.10 add nested member", {"foo": "bar"}, [{"op": "add", "path": "/child", "value": {"grandchild": {}}}],
     {"foo": "bar", "child": {"grandchild": {}}}),
    ("A.11 ignore unrecognized elements", {"foo": "bar"},
     [{"op": "add", "path": "/baz", "value": "qux", "xyz": 123}], {"foo": "bar", "baz": "qux"}),
    ("A.14 ~ escape ordering", {"/": 9, "~1": 10}, [{"op": "test", "path": "/~01", "value": 10}],
     {"/": 9, "~1": 10}),
    ("A.16 add array value", {"foo": ["bar"]}, [{"op": "add", "path": "/foo/-", "value": ["abc", "def"]}],
     {"foo": ["bar", ["abc", "def"]]}),
    ("copy", {"a": {"b": 1}}, [{"op": "copy", "from": "/a", "path": "/c"}], {"a": {"b": 1}, "c": {"b": 1}}),
    ("replace whole document", {"a": 1}, [{"op": "replace", "path": "", "value": [1]}], [1]),
]


@pytest.mark.parametrize("name,doc,ops,expected", RFC6902_EXAMPLES, ids=[e[0] for e in RFC6902_EXAMPLES])
def test_json_patch_rfc6902_examples(name, doc, ops, expected):
    before = copy.deepcopy(doc)
    assert json_patch(doc, ops) == expected
    assert doc == before


RFC6902_ERRORS = [
    ("A.9 test error", {"baz": "qux"}, [{"op": "test", "path": "/baz", "value": "bar"}]),
    ("A.12 add to nonexistent target", {"foo": "bar"}, [{"op": "add", "path": "/baz/bat", "value": "qux"}]),
    ("A.15 strings and numbers differ", {"/": 9, "~1": 10}, [{"op": "test", "path": "/~01", "value": "10"}]),
    ("remove missing member", {"a": 1}, [{"op": "remove", "path": "/b"}]),
    ("index past the end", {"a": [1]}, [{"op": "add", "path": "/a/2", "value": 0}]),
    ("leading zero index", {"a": [1, 2]}, [{"op": "replace", "path": "/a/01", "value": 0}]),
    ("move into own child", {"a": {"b": {}}}, [{"op": "move", "from": "/a", "path": "/a/b/c"}]),
    ("true is not 1", {"a": 1}, [{"op": "test", "path": "/a", "value": True}]),
]


@pytest.mark.parametrize("name,doc,ops", RFC6902_ERRORS, ids=[e[0] for e in RFC6902_ERRORS])
def test_json_patch_rfc6902_errors_are_422(name, doc, ops):
    with pytest.raises(PatchError) as err:
        json_patch(doc, ops)
    assert err.value.code == 422


def test_json_patch_is_all_or_nothing_and_malformed_ops_are_400():
    doc = {"a": 1}
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "add", "path": "/b", "value": 2}, {"op": "test", "path": "/a", "value": 2}])
    assert doc == {"a": 1}
    for bad in ({"op": "add"}, {"op": "frobnicate", "path": "/a"}, {"op": "add", "path": "/a"}, "add"):
        with pytest.raises(PatchError) as err:
            json_patch(doc, [bad])
        assert err.value.code == 400
    with pytest.raises(PatchError):
        json_patch(doc, {"op": "add"})


def test_json_pointer_and_equality():
    assert parse_pointer("") == []
    assert parse_pointer("/a~1b/m~0n/") == ["a/b", "m~n", ""]
    assert json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not json_equal(1, True) and not json_equal([1], [1, 2]) and not json_equal({"a": 1}, {"b": 1})


# --- Strategic merge on nodes -----------------------------------------------------------------------

def kubelet_node() -> dict:
    return {
        "metadata": {"name": "n1", "labels": {"a": "1", "b": "2"}, "finalizers": ["x", "y"]},
        "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}], "podCIDRs": ["10.0.0.0/24"]},
        "status": {
            "conditions": [{"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                           {"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": "n1"}],
            "images": [{"names": ["a"]}, {"names": ["b"]}],
            "capacity": {"cpu": "8", "nvidia.com/gpu": "8"},
        },
    }


def smp(original: dict, patch: dict) -> dict:
    before = copy.deepcopy(original)
    result = strategic_merge_patch(original, patch, NODES.merge_keys)
    assert original == before, "the original must not change"
    return result


def test_conditions_merge_by_type():
    node = kubelet_node()
    out = smp(node, {"status": {"conditions": [{"type": "GpuHealthy", "status": "False"},
                                               {"type": "Ready", "message": "fine"}]}})
    assert out["status"]["conditions"] == [
        {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fine"},
        {"type": "GpuHealthy", "status": "False"}]
    assert out["status"]["capacity"] == node["status"]["capacity"]
    assert out["metadata"] == node["metadata"]


def test_delete_directive_and_null_in_merged_lists():
    out = smp(kubelet_node(), {"status": {"conditions": [{"type": "Ready", "$patch": "delete"},
                                                         {"type": "MemoryPressure", "reason": None}]}})
    assert out["status"]["conditions"] == [{"type": "MemoryPressure", "status": "False"}]
    out = smp(kubelet_node(), {"status": {"conditions": [{"type": "Absent", "$patch": "delete"}]}})
    assert len(out["status"]["conditions"]) == 2


def test_addresses_and_taints_merge_by_their_keys_and_images_are_replaced():
    out = smp(kubelet_node(), {"status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.9"}],
                                          "images": [{"names": ["c"]}]},
                               "spec": {"taints": [{"key": "dead", "effect": "NoExecute"}]}})
    assert out["status"]["addresses"] == [{"type": "InternalIP", "address": "10.0.0.9"},
                                          {"type": "Hostname", "address": "n1"}]
    assert out["status"]["images"] == [{"names": ["c"]}]
    assert [t["key"] for t in out["spec"]["taints"]] == ["gpu", "dead"]


def test_replace_directive_on_list_and_map():
    out = smp(kubelet_node(), {"status": {"conditions": [{"$patch": "replace"}, {"type": "Ready", "status": "False"}]}})
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "False"}]
    out = smp(kubelet_node(), {"metadata": {"labels": {"$patch": "replace", "c": "3"}}})
    assert out["metadata"]["labels"] == {"c": "3"}
    out = smp(kubelet_node(), {"status": {"capacity": {"$patch": "delete"}}})
    assert out["status"]["capacity"] == {}


def test_null_deletes_a_key_and_plain_values_replace():
    out = smp(kubelet_node(), {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"unschedulable": True}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["unschedulable"] is True
    assert "spec" not in smp(kubelet_node(), {"spec": None})


def test_primitive_lists_union_and_delete_from_primitive_list():
    out = smp(kubelet_node(), {"metadata": {"finalizers": ["y", "z"], "$deleteFromPrimitiveList/finalizers": ["x"]}})
    assert out["metadata"]["finalizers"] == ["y", "z"]
    assert smp(kubelet_node(), {"spec": {"podCIDRs": ["10.0.1.0/24"]}})["spec"]["podCIDRs"] == [
        "10.0.0.0/24", "10.0.1.0/24"]


def test_set_element_order_is_accepted():
    out = smp(kubelet_node(), {"status": {
        "$setElementOrder/conditions": [{"type": "Ready"}, {"type": "MemoryPressure"}],
        "conditions": [{"type": "Ready", "status": "False"}]}})
    assert [(c["type"], c["status"]) for c in out["status"]["conditions"]] == [("Ready", "False"),
                                                                             ("MemoryPressure", "False")]


def test_retain_keys_and_directives_never_stored():
    out = smp(kubelet_node(), {"status": {"$retainKeys": ["conditions"], "conditions": []}})
    assert set(out["status"]) == {"conditions"}
    out = smp({"metadata": {"name": "n1"}}, {"status": {"conditions": [{"type": "X", "status": "True",
                                                                        "$patch": "merge"}]}})
    assert out["status"]["conditions"] == [{"type": "X", "status": "True"}]


def test_merge_key_missing_is_an_error():
    with pytest.raises(PatchError, match="does not contain declared merge key: type"):
        smp(kubelet_node(), {"status": {"conditions": [{"status": "True"}]}})


def test_lists_without_merge_key_in_schema_are_replaced():
    out = strategic_merge_patch({"a": {"list": [1, 2]}}, {"a": {"list": [3]}}, {})
    assert out == {"a": {"list": [3]}}
    out = strategic_merge_patch({"a": [1]}, {"a": [2]}, {"a": PRIMITIVE})
    assert out == {"a": [1, 2]}


def test_apply_patch_dispatches_on_content_type():
    node = kubelet_node()
    body = {"status": {"conditions": [{"type": "X", "status": "True"}]}}
    assert len(apply_patch("application/strategic-merge-patch+json", node, body, NODES.merge_keys)
               ["status"]["conditions"]) == 3
    assert len(apply_patch("application/merge-patch+json; charset=utf-8", node, body, NODES.merge_keys)
               ["status"]["conditions"]) == 1
    assert apply_patch("application/json-patch+json", node, [{"op": "remove", "path": "/status"}],
                       NODES.merge_keys).keys() == {"metadata", "spec"}
    with pytest.raises(UnsupportedPatchType) as err:
        apply_patch("application/json", node, body, NODES.merge_keys)
    assert err.value.code == 415
    with pytest.raises(PatchError) as err:
        apply_patch("application/strategic-merge-patch+json", node, [body], NODES.merge_keys)
    assert err.value.code == 400
