"""``sart serve --generation-config``: requests that leave sampling unset take the model's
``generation_config.json`` defaults, as ``vllm serve`` gives them (flags resolved by
``model_defaults.with_model_defaults``, requests planned by ``protocol.plan``, and a served
testbed whose generation config makes unset temperature greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sart.cli import _parser
from sart.errors import ConfigError
from sart.serve import ServeConfig, command, model_defaults
from sart.serve.protocol import CompletionRequest, parse, plan
from sart.types import SamplingSettings

QWEN_LIKE = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "max_new_tokens": 512,
    "eos_token_id": 2,
}


def resolved(*flags: str) -> ServeConfig:
    args = _parser().parse_args(["serve", *flags])
    command.load_spec_of(args)
    config = command.serve_config(args, has_prm=False)
    return model_defaults.with_model_defaults(config, args)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return tmp_path


def test_unset_flags_take_the_models_generation_config(model: Path) -> None:
    config = resolved("--model", str(model), "--served-model-name", "m")
    assert (config.temperature, config.top_p) == (0.7, 0.8)
    # max_new_tokens caps every request, as vllm serve's does.
    assert (config.max_tokens, config.max_tokens_limit) == (512, 512)
    assert config.sampling == {"top_k": 20}


def test_flags_win_over_the_generation_config(model: Path) -> None:
    config = resolved("--model", str(model), "--temperature", "0.3", "--max-tokens", "100")
    assert (config.temperature, config.top_p, config.max_tokens) == (0.3, 0.8, 100)
    limited = resolved("--model", str(model), "--max-tokens-limit", "4096")
    assert (limited.max_tokens, limited.max_tokens_limit) == (512, 4096)
    # A limit alone lowers sart's default to it (16384 was refused as over the limit).
    own = resolved(
        "--model", str(model), "--generation-config", "sart", "--max-tokens-limit", "4096"
    )
    assert (own.max_tokens, own.max_tokens_limit) == (4096, 4096)


def test_sart_and_an_override_choose_other_defaults(model: Path) -> None:
    own = resolved("--model", str(model), "--generation-config", "sart")
    settings = SamplingSettings()
    assert (own.temperature, own.top_p, own.sampling) == (
        settings.temperature,
        settings.top_p,
        {},
    )
    over = resolved("--model", str(model), "--override-generation-config", '{"min_p": 0.05}')
    assert (over.temperature, over.sampling) == (0.7, {"top_k": 20, "min_p": 0.05})


def test_a_bad_override_is_a_one_line_error(model: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--override-generation-config", "[1]"])
    assert "--override-generation-config: '[1]' is not a JSON object" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"override_generation_config=.*seed is not one of"):
        resolved("--model", str(model), "--override-generation-config", '{"seed": 1}')


def test_a_request_sets_what_it_sets_and_the_model_the_rest(model: Path) -> None:
    config = resolved("--model", str(model), "--served-model-name", "m")

    def sampling(body: dict) -> SamplingSettings:
        request = parse(
            CompletionRequest, json.dumps({"model": "m", "prompt": "x", **body}).encode()
        )
        return plan(request, config).request_kwargs["sampling"]

    default = sampling({})
    assert (default.temperature, default.top_p, default.top_k, default.max_tokens) == (
        0.7,
        0.8,
        20,
        512,
    )
    own = sampling({"temperature": 1.0, "top_k": 5, "top_p": 1.0})
    assert (own.temperature, own.top_p, own.top_k) == (1.0, 1.0, 5)


def test_defaults_an_engine_does_not_honour_stop_the_start() -> None:
    config = ServeConfig(models=("m",), sampling={"top_k": 20})

    class Plain:  # an engine that honours none of vLLM's extra fields
        pass

    with pytest.raises(ConfigError, match=r"\{'top_k': 20\}: --engine plain does not honour"):
        model_defaults.check_honoured(config, Plain(), "plain")
    model_defaults.check_honoured(ServeConfig(models=("m",)), Plain(), "plain")


def test_a_served_model_whose_generation_config_is_greedy(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("transformers")
    import httpx

    from serving import KEY, Server

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0}')
    flags = ("--api-key", KEY, "--method", "vanilla", "--max-tokens", "24")
    server = Server(*flags, "--generation-config", str(tmp_path))
    try:
        headers = {"Authorization": f"Bearer {KEY}"}

        def text(**body: object) -> str:
            ask = {"model": "testbed", "prompt": "Compute 17 + 25.", **body}
            reply = httpx.post(
                f"{server.url}/v1/completions", json=ask, headers=headers, timeout=60
            )
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        # Unset temperature is the file's 0: greedy, whatever the seed.
        assert text(seed=1) == text(seed=2) == text(temperature=0.0)
        assert text(seed=1, temperature=1.0) != text(seed=2, temperature=1.0)
    finally:
        code, log = server.stop()
    assert code == 0, log
    assert "requests that do not say sample with {'temperature': 0.0, 'top_p': 1.0}" in log


def test_serve_config_checks_its_sampling_defaults() -> None:
    with pytest.raises(ConfigError, match=r"sampling=\{'seed': 1\} must be a dict of top_k"):
        ServeConfig(models=("m",), sampling={"seed": 1})
    with pytest.raises(ConfigError, match="min_p=2"):
        ServeConfig(models=("m",), sampling={"min_p": 2})


def test_a_named_file_or_an_override_is_checked_before_the_models_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # _serve loads the models (the testbed here): these end the command first, in the
    # words of their flags.
    monkeypatch.setattr(command, "_serve", lambda *a: pytest.fail("the models loaded"))
    for flags, message in (
        (["--generation-config", str(tmp_path / "nowhere")], "--generation-config '"),
        (["--override-generation-config", '{"top_p": 2}'], "--override-generation-config {"),
    ):
        args = _parser().parse_args(["serve", *flags])
        with pytest.raises(ConfigError) as info:
            command.run_serve_command(args)
        assert str(info.value).startswith(message)
