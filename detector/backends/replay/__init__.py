"""`--nvml replay:PATH`: a node rebuilt from what a real machine printed (nvidia-smi -q text or -q -x XML,
and the files captured beside it), judged by the same checks as a live node, as one snapshot.

Layers: load (find the file) -> text_form / xml_form (parse into tree.Node) -> fields (read a Snapshot)
-> nvml / host (answer the detector's backends from it); side_files reads the optional captures.
"""
