"""Value types: ids, ordered statuses, sampling settings, requests, results."""

from __future__ import annotations

import pytest

import sart
from sart.types import BranchId, BranchStatus, default_seed


def test_branch_status_is_ordered_and_past_running_means_ended() -> None:
    order = ["WAITING", "RUNNING", "FINISHED", "TRUNCATED", "PRUNED", "STOPPED", "FAILED"]
    assert [s.name for s in sorted(BranchStatus)] == order
    assert [s.is_ended for s in BranchStatus] == [False, False] + [True] * 5
    assert {s for s in BranchStatus if s.is_completed} == {
        BranchStatus.FINISHED,
        BranchStatus.TRUNCATED,
    }


def test_branch_id_prints_like_vllm_child_requests() -> None:
    assert str(BranchId("req-7", 3)) == "3_req-7"


def test_seeds_differ_per_request_and_per_branch() -> None:
    a = sart.Request("a", "p", sart.vanilla())
    b = sart.Request("b", "p", sart.vanilla())
    assert a.seed != b.seed
    assert a.seed == default_seed("a")
    fixed = sart.Request("c", "p", sart.vanilla(), sampling=sart.SamplingSettings(seed=5))
    assert fixed.seed == 5


def test_request_converts_token_lists() -> None:
    assert sart.Request("a", [1, 2, 3], sart.vanilla()).prompt == (1, 2, 3)


def test_an_arrival_from_numpy_is_a_float() -> None:
    np = pytest.importorskip("numpy")
    assert sart.Request("a", "p", sart.vanilla(), arrival=np.int64(3)).arrival == 3.0


def test_request_takes_sampling_as_a_dict_of_its_fields() -> None:
    request = sart.Request("a", "p", sart.vanilla(), sampling={"max_tokens": 5, "seed": 1})
    assert request.sampling == sart.SamplingSettings(max_tokens=5, seed=1)


def test_one_stop_string_is_one_stop_string_as_vllm_takes_it() -> None:
    assert sart.SamplingSettings(stop="###").stop == ("###",)
    assert sart.SamplingSettings(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sart.SamplingSettings(temperature=-1.0), "temperature=-1.0 must be a number >="),
        (lambda: sart.SamplingSettings(temperature=None), "temperature=None must be a number"),
        (lambda: sart.SamplingSettings(temperature="0.6"), "temperature='0.6' must be a number"),
        (lambda: sart.SamplingSettings(top_p=0.0), "top_p=0.0 must be a number in (0, 1]"),
        (lambda: sart.SamplingSettings(top_p="1"), "top_p='1' must be a number in (0, 1]"),
        (lambda: sart.SamplingSettings(stop=5), "stop=5 must be a string or a list of strings"),
        (lambda: sart.SamplingSettings(stop=["a", 1]), "stop=['a', 1] must be a string or a"),
        (lambda: sart.SamplingSettings(stop_token_ids=5), "stop_token_ids=5 must be a list of"),
        (lambda: sart.SamplingSettings(max_tokens=0), "max_tokens=0 must be >= 1"),
        (lambda: sart.SamplingSettings(seed=-3), "seed=-3 must be None or an int >= 0"),
        (lambda: sart.Request("", "p", sart.vanilla()), "id='' must be a non-empty str"),
        (lambda: sart.Request("a", [], sart.vanilla()), "must be a non-empty str or tuple"),
        (lambda: sart.Request("a", "", sart.vanilla()), "prompt='' must be a non-empty str"),
        (lambda: sart.Request("a", "p", sart.vanilla(), sampling=None), "sampling=None must be"),
        (
            lambda: sart.Request("a", "p", sart.vanilla(), sampling={"max_token": 5}),
            "SamplingSettings has no field 'max_token'",
        ),
        (lambda: sart.Request("a", "p", sart.vanilla(), arrival="x"), "arrival='x' must be"),
        (lambda: sart.Request("a", "p", "sart"), "policy='sart' must be a sart.Policy"),
        (lambda: sart.Request("a", "p", sart.vanilla(), arrival=-1), "arrival=-1.0 must be"),
    ],
)
def test_bad_values_raise_config_error(make, message: str) -> None:
    with pytest.raises(sart.ConfigError, match=None) as info:
        make()
    assert message in str(info.value)


def test_timings_derive_latencies() -> None:
    t = sart.Timings(arrival=1.0, scheduled=3.0, finished=10.0)
    assert (t.queueing, t.inference, t.end_to_end) == (2.0, 7.0, 9.0)
    never = sart.Timings(arrival=1.0, scheduled=None, finished=4.0)
    assert (never.queueing, never.inference) == (3.0, 0.0)
