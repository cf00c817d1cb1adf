"""A model's sampling defaults from its ``generation_config.json`` (``sart.generation_config``),
read as ``vllm serve`` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sart.errors import ConfigError
from sart.generation_config import generation_defaults, generation_file

QWEN_LIKE = {
    "bos_token_id": 1,
    "do_sample": True,  # not a default vLLM reads
    "eos_token_id": [2, 3],
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 512,
    "transformers_version": "5.0.0",
}


def model_dir(tmp_path: Path, config: dict | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_keys_vllm_reads_from_the_models_directory(tmp_path: Path) -> None:
    model = model_dir(tmp_path, QWEN_LIKE)
    assert generation_defaults("auto", str(model)) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 512,  # max_new_tokens, by vLLM's name
    }


def test_no_file_no_defaults_and_sart_reads_none(tmp_path: Path) -> None:
    assert generation_defaults("auto", str(model_dir(tmp_path / "a", None))) == {}
    assert generation_defaults("auto", None) == {}
    # A hub id not in the cache: nothing, and no network (offline that is ~25 s of retries).
    assert generation_defaults("auto", "nosuchorg/nosuchmodel") == {}
    assert generation_defaults("auto", str(tmp_path / "not" / "there")) == {}  # no hub id
    assert generation_defaults("sart", str(model_dir(tmp_path / "b", QWEN_LIKE))) == {}


def test_a_directory_or_file_named_is_read_whatever_the_model(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, {"temperature": 0.0})
    assert generation_defaults(str(folder), "nosuchorg/nosuchmodel") == {"temperature": 0.0}
    assert generation_defaults(str(folder / "generation_config.json"), None) == {"temperature": 0.0}
    assert generation_file(str(folder), None) == folder / "generation_config.json"
    with pytest.raises(ConfigError, match=r"generation_config='.*nowhere'.*no such file"):
        generation_defaults(str(tmp_path / "nowhere"), None)


def test_an_override_is_laid_over_the_file(tmp_path: Path) -> None:
    model = str(model_dir(tmp_path, QWEN_LIKE))
    found = generation_defaults("auto", model, {"temperature": 0.5, "top_k": None})
    assert (found["temperature"], "top_k" in found, found["top_p"]) == (0.5, False, 0.8)
    assert generation_defaults("sart", model, {"min_p": 0.1}) == {"min_p": 0.1}
    with pytest.raises(ConfigError, match=r"override_generation_config=.*do_sample is not one"):
        generation_defaults("auto", model, {"do_sample": False})


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_a_bad_value_is_refused_naming_the_file_and_field(
    tmp_path: Path, config: dict, field: str
) -> None:
    model = model_dir(tmp_path, config)
    with pytest.raises(ConfigError, match=rf"generation_config=.{model}.*.: {field}="):
        generation_defaults("auto", str(model))


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        generation_defaults("auto", str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        generation_defaults("auto", str(tmp_path))


def test_an_error_names_what_gave_the_bad_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^override_generation_config=\{'top_p': 2\}: top_p="):
        generation_defaults("sart", None, {"top_p": 2})
    model = model_dir(tmp_path, {"temperature": 0.5})
    with pytest.raises(ConfigError, match=r"json' with the override \{'top_p': 2\}: top_p="):
        generation_defaults("auto", str(model), {"top_p": 2})
