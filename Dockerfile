# One image for every Tison process; the command picks the role (see compose.yaml).
FROM python:3.11-slim
# a C compiler: the CPU kernels and the codec's decoder are built on first use (for the host CPU)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
COPY loadtest loadtest
# CPU torch by default; build with --build-arg TORCH_SPEC="torch" on a CUDA base for GPUs.
ARG TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
RUN pip install --no-cache-dir $TORCH_SPEC && pip install --no-cache-dir -e .
ENTRYPOINT ["tison"]
