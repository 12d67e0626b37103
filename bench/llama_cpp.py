"""llama.cpp's `llama-server`, the peer the benchmarks compare nanoserve against, built from source.

    python -m bench.llama_cpp build                       # once: ~10+ minutes on 2 cores
    python -m bench.llama_cpp convert --precision q8_0    # the GPT-2 small checkpoint as GGUF
    python -m bench.llama_cpp serve --precision f32 --slots 8    # serves until Ctrl-C, e.g. for
    python -m bench.loadgen --base-url http://127.0.0.1:PORT/v1 --model gpt2-small --stream
    python -m bench.serving_bench --server llama.cpp:q8_0    # started and stopped by the benchmark

llama.cpp is not a dependency of nanoserve: its sources come from the copy vendored in PyPI's
`llama-cpp-python` sdist (a pinned, reproducible snapshot that pip can fetch like any package), are
built with cmake into bench/.cache/llama.cpp/ and reused from there. Its converter,
`convert_hf_to_gguf.py`, imports the `gguf` package from the same sources (put on PYTHONPATH for
that one process only) and torch and transformers, which the dev environment already has.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from bench import CACHE, checkpoint
from web.dev.local_redis import free_port

VERSION = "0.3.36"  # llama-cpp-python's release; its sdist pins the llama.cpp sources
ROOT = CACHE / "llama.cpp"
SOURCES = ROOT / "src"
BUILD = ROOT / "build-native-noamx"  # named by its configuration: a change of flags builds anew
SERVER = BUILD / "bin" / "llama-server"
# ggml's AMX int8 matmul (the q8_0 path on CPUs with AMX) faults on its first `ldtilecfg` on the
# AMX Xeon (docs/notes/llama-cpp-build.md) and kills the server; built without it, q8_0 runs on the
# AVX-512 kernels with their weight repacking, and f32 and f16 (which that path never used) are unchanged
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# convert_hf_to_gguf's --outtype names, held against nanoserve's float32, bfloat16 and int8
PRECISIONS = ("f32", "f16", "q8_0")


def sources() -> Path:
    """llama.cpp's source tree, unpacked once from the llama-cpp-python sdist."""
    if (SOURCES / "CMakeLists.txt").exists():
        return SOURCES
    sdist_dir = ROOT / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(sdist_dir), f"llama-cpp-python=={VERSION}"], check=True)
    vendored = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    # unpack beside the target, then rename: an interrupted unpack never looks finished
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=ROOT))
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(vendored)]
        for member in members:
            member.name = member.name[len(vendored):]
        archive.extractall(tmp, members=[m for m in members if m.name], filter="data")
    if SOURCES.exists():
        shutil.rmtree(SOURCES)
    tmp.rename(SOURCES)
    return SOURCES


def build(jobs: int | None = None) -> Path:
    """The `llama-server` binary, built on first use (Release, this CPU's native instructions but AMX, only
    the server target, no network features) at the lowest CPU priority, then reused."""
    if SERVER.exists():
        return SERVER
    src = sources()
    nice = ["nice", "-n", "19"]
    subprocess.run(nice + ["cmake", "-S", str(src), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                           "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
                           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                           "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
                   + (["-G", "Ninja"] if shutil.which("ninja") else []), check=True)
    subprocess.run(nice + ["cmake", "--build", str(BUILD), "--target", "llama-server", "--parallel",
                           str(jobs or os.cpu_count() or 1)], check=True)
    return SERVER


def convert(hf_checkpoint: Path, precision: str = "f32") -> Path:
    """`hf_checkpoint` (a Hugging Face directory) as a GGUF file of `precision` (f32, f16 or q8_0),
    converted once with llama.cpp's own `convert_hf_to_gguf.py` and then reused."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    hf_checkpoint = Path(hf_checkpoint).resolve()
    out = ROOT / "gguf" / f"{hf_checkpoint.name}-{precision}.gguf"
    if out.exists() and out.stat().st_mtime >= (hf_checkpoint / "config.json").stat().st_mtime:
        return out
    src = sources()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    # the converter's `gguf` package comes from the same sources, for this process alone
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="gguf-input-") as view:
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(_converter_view(hf_checkpoint, view)),
                        "--outfile", str(tmp), "--outtype", precision, "--model-name", hf_checkpoint.name],
                       check=True, env=env)
    tmp.rename(out)
    return out


def _converter_view(hf_checkpoint: Path, directory: str) -> Path:
    """The checkpoint as the converter reads it: its files linked into `directory`, with GPT-2's
    context length also under `n_ctx`, the original config's key, which the converter reads and
    transformers no longer writes (it writes `n_positions` alone)."""
    view = Path(directory)
    for path in hf_checkpoint.iterdir():
        if path.name != "config.json":
            (view / path.name).symlink_to(path)
    config = json.loads((hf_checkpoint / "config.json").read_text())
    if config.get("model_type") == "gpt2":
        config.setdefault("n_ctx", config["n_positions"])
    (view / "config.json").write_text(json.dumps(config, indent=1))
    return view


@contextmanager
def llama_server(gguf: Path, *, slots: int = 8, slot_context: int = 512, threads: int | None = None,
                 alias: str | None = None, log_dir: Path | None = None, timeout: float = 120.0):
    """`llama-server` serving `gguf` on 127.0.0.1 until the block ends; yields its OpenAI base URL.

    `slots` sequences decode together (`--parallel`, continuous batching on), each with
    `slot_context` tokens of context (`-c` is the whole KV cache: slots × slot_context), on
    `threads` threads (default: every core, as llama.cpp is usually run)."""
    binary = build()
    port = free_port()
    threads = threads or os.cpu_count() or 1
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "--parallel", str(slots), "-c", str(slots * slot_context),
            "--cont-batching", "--no-webui"] + (["--alias", alias] if alias else [])
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="llama-server-")) / f"llama-server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {process.returncode}; log tail:\n"
                                   f"{log_path.read_text(errors='replace')[-4000:]}")
            try:
                # /health answers 503 while the model loads, 200 once it serves
                with urllib.request.urlopen(url + "/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready within {timeout}s; log: {log_path}")
            time.sleep(0.2)
        yield url + "/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "convert", "serve"])
    parser.add_argument("--model", default="gpt2-small", help="the random-weight checkpoint's shape (bench.SHAPES)")
    parser.add_argument("--checkpoint", default=None, help="a Hugging Face directory instead of --model")
    parser.add_argument("--precision", default="f32", choices=PRECISIONS)
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together (--parallel)")
    parser.add_argument("--slot-context", type=int, default=512, help="tokens of context per slot")
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build())
        return
    hf = Path(args.checkpoint) if args.checkpoint else checkpoint(args.model)
    gguf = convert(hf, args.precision)
    if args.command == "convert":
        print(gguf)
        return
    with llama_server(gguf, slots=args.slots, slot_context=args.slot_context, threads=args.threads,
                      alias=args.model) as url:
        print(f"serving {gguf.name} at {url} (model {args.model!r}); Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
