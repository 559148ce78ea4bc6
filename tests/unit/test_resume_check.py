"""The resume check: a folder of other settings is refused naming what differs, in the options' own values."""

import pytest

from speculators_v016.store import run_config
from speculators_v016.store.run_config import ResumeMismatchError, check_resume


def fingerprint(storage=None) -> dict:
    generation = {"layer_ids": [2, 4], "format": "safetensors", "dtype": "bfloat16"}
    if storage is not None:  # as the pipeline writes it: absent for the default, auto
        generation["hidden_states_dtype"] = storage
    return {"model": {"name": "m"}, "generation": generation}


def save(folder, fp) -> None:
    run_config.save(folder, {"speculators_v016": {"fingerprint": fp}})


def test_a_resume_for_another_storage_names_auto_not_none(tmp_path):
    """FP8 folder resumed with the default storage, and the reverse: the message says 'auto', never None."""
    save(tmp_path, fingerprint("fp8_e4m3"))
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path, fingerprint(), has_samples=True)
    assert "generation.hidden_states_dtype: 'fp8_e4m3' -> 'auto'" in str(raised.value)
    assert "None" not in str(raised.value)
    save(tmp_path, fingerprint())
    with pytest.raises(ResumeMismatchError, match=r"generation.hidden_states_dtype: 'auto' -> 'fp8_e4m3'"):
        check_resume(tmp_path, fingerprint("fp8_e4m3"), has_samples=True)


def test_the_default_storage_resumes_a_folder_of_an_earlier_release(tmp_path):
    """A fingerprint without the field (earlier releases, or auto) matches one that says auto."""
    save(tmp_path, fingerprint())
    assert check_resume(tmp_path, fingerprint("auto"), has_samples=True) is not None
    assert check_resume(tmp_path, fingerprint(), has_samples=True) is not None
