# gpu-npd image: the detector, its bundled rules, the fake NVML backend (for `--nvml fake:...`) and
# the Kubernetes API emulator.
# The NVIDIA driver's libraries (NVML) and nvidia-smi are not in the image: the NVIDIA container
# runtime injects them (runtimeClassName: nvidia, NVIDIA_DRIVER_CAPABILITIES=utility).
#
#   docker build -t gpu-npd:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
# rules/ is packaged through the symlink detector/rules/builtin -> ../../rules, so both are copied
# at their places in the tree.
COPY rules/ rules/
COPY detector/ detector/
COPY fake_nvml/ fake_nvml/
COPY kube_emulator/ kube_emulator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/gpu_npd-*.whl')[0]).namelist(); sys.exit(0 if any(n.startswith('detector/rules/builtin/') and n.endswith('.yaml') for n in names) else 'bundled rules missing from the wheel')"

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
 && rm -rf /wheels \
 && gpu-npd validate-rules
EXPOSE 9808
ENTRYPOINT ["gpu-npd"]
CMD ["run"]
