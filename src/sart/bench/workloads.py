"""Generative workloads: Poisson arrivals and branches that behave like reasoning traces.

The model encodes the paper's observations and states its assumptions.

From the paper (section 3, Figure 2): reasoning responses run to thousands
of tokens and, for the *same* request, vary several-fold in length; wrong
responses tend to be the longer ones (over-thinking, Observation 1).
From its setup (section 5.1): arrival rates of 1 and 4 requests/s.

Assumptions (ours, not the paper's; none was tuned to reproduce its numbers):

- each request has a difficulty: its per-branch probability of a correct
  answer ``p`` is drawn from Beta with mean ``accuracy``; harder requests
  think longer (their log median length grows with ``accuracy - p``);
- a branch's length is lognormal around its request's median, with a spread
  that itself varies across requests (``sigma_spread``); a wrong branch runs
  ``exp(overthink)`` times longer on average, and loops until ``max_tokens``
  with probability ``loop_share``; a branch that reaches ``max_tokens`` is cut
  there and has no answer (recorded as ``""``, as from a real engine);
- a wrong branch picks one of ``wrong_answers`` wrong values with
  request-specific Dirichlet weights, so wrong answers cluster but are spread
  enough that majority voting helps;
- the PRM is informative but noisy: a branch has a latent logit quality,
  higher by ``prm_separation`` for correct branches, plus a persistent
  per-branch offset; the reward after ``t`` tokens is
  ``sigmoid(bias + w(t) (quality - bias) + noise)`` with
  ``w(t) = 1 - exp(-t / prm_warmup)``, so early rewards say little; the final
  reward is ``sigmoid(quality + noise / 2)``. The presets give a PRM of
  moderate quality: its final reward ranks a correct branch above a wrong one
  with probability (AUROC) about 0.75 (gaokao) and 0.73 (gpqa), measured on
  3,200 generated branches each.

The presets' lengths (medians 3,500 and 6,000 tokens, several-fold spread)
follow the paper's Figure 2; accuracies (0.7 and 0.55 per branch) are
assumptions in the range reported for DeepSeek-R1-Distill models on such
benchmarks, not numbers from the paper. The length parameters
(``branch_sigma``, ``sigma_spread``, ``overthink``, ``loop_share``) are fitted so
that each question's rollouts have the shape of real ones
(``sart.rollouts.REAL_RANGES``: length CV, longest / shortest,
length-correctness correlation, correct / wrong length, share at the cap);
``sart trace stats --workload NAME`` prints them.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import attrs

from sart.bench.resample import ResampledWorkload, load_resampled
from sart.bench.traces import Trace, TraceRequest, is_trace_file
from sart.engines.scripts import BranchScript
from sart.errors import ConfigError, config_check
from sart.registry import preset


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@attrs.frozen
class WorkloadModel:
    """Parameters of the generative workload (see the module docstring)."""

    name: str
    median_length: float
    """Median response length (tokens) of a request of average difficulty
    (``p = accuracy``)."""
    request_sigma: float
    """Lognormal spread of request medians (across requests)."""
    branch_sigma: float
    """Lognormal spread of branch lengths within one request."""
    difficulty_length: float
    """Log-length added per unit of ``accuracy - p`` (harder requests think longer)."""
    max_tokens: int
    accuracy: float
    """Mean probability that a branch is correct."""
    accuracy_concentration: float
    """Beta concentration of per-request ``p`` (small: requests are easy or hard)."""
    wrong_answers: int
    wrong_concentration: float
    """Dirichlet concentration over wrong answers (small: they cluster)."""
    prompt_tokens: int
    prm_bias: float
    prm_separation: float
    prm_branch_noise: float
    prm_noise: float
    prm_warmup: float
    """Tokens over which PRM rewards become informative."""
    answers: tuple[str, ...] = ()
    """Answer labels (multiple choice); empty: numbers as strings."""
    sigma_spread: float = 0.0
    """Lognormal spread of ``branch_sigma`` across requests (some questions'
    rollouts agree on a length, others scatter)."""
    overthink: float = 0.0
    """Log-length added to a wrong branch: wrong rollouts run longer (over-thinking)."""
    loop_share: float = 0.0
    """Chance that a wrong branch loops until ``max_tokens`` (truncated, no answer)."""

    def generate(
        self, num_requests: int, rate: float, n: int, interval: int, seed: int = 0
    ) -> Trace:
        """``num_requests`` requests with Poisson arrivals at ``rate`` per second, ``n``
        branches each, rewards recorded every ``interval`` tokens."""
        config_check(num_requests >= 1, "num_requests", num_requests, ">= 1")
        config_check(rate > 0, "rate", rate, "> 0")
        config_check(n >= 1, "n", n, ">= 1")
        config_check(interval >= 1, "interval", interval, ">= 1")
        # Separate random streams for arrivals, each request and each branch, so
        # that changing n or T changes nothing else: branch j of request i is the
        # same whatever the other settings (common random numbers across sweeps).
        arrivals = random.Random(f"{self.name}/{seed}/{rate}/arrivals")
        arrival = 0.0
        requests = []
        for i in range(num_requests):
            arrival += arrivals.expovariate(rate)
            stream = f"{self.name}/{seed}/{rate}/{i}"
            requests.append(self._request(stream, f"r{i}", arrival, n, interval))
        # A child takes its source's rewards as they are: they are draws around that
        # branch's latent quality, not ratings of the prefix it shares with its parent.
        # Whether it is right follows its request's answers, not the fork model fitted
        # to a real PRM's rewards (``Trace.fork_model``).
        return Trace.of(requests, persistence=0.0, fork_model=None)

    def _request(
        self, stream: str, rid: str, arrival: float, n: int, interval: int
    ) -> TraceRequest:
        rng = random.Random(stream)
        k = self.accuracy_concentration
        p = rng.betavariate(self.accuracy * k, (1.0 - self.accuracy) * k)
        median = self.median_length * math.exp(
            rng.gauss(0.0, self.request_sigma) + self.difficulty_length * (self.accuracy - p)
        )
        labels = self._labels(rng)
        gold, wrong = labels[0], labels[1:]
        sigma = self.branch_sigma * math.exp(rng.gauss(0.0, self.sigma_spread))
        weights = [rng.gammavariate(self.wrong_concentration, 1.0) for _ in wrong]
        branches = []
        for index in range(n):
            rng = random.Random(f"{stream}/{index}")
            correct = rng.random() < p
            answer = gold if correct else rng.choices(wrong, weights)[0]
            shift = 0.0 if correct else self.overthink
            length = max(1, round(median * math.exp(rng.gauss(shift, sigma))))
            if not correct and self.loop_share and rng.random() < self.loop_share:
                length = self.max_tokens + 1  # a loop
            if length > self.max_tokens:
                # Cut at the cap before it writes an answer: a recorded trace says so
                # (no answer), as one recorded from a real engine does.
                length, answer = self.max_tokens + 1, ""
            quality = (
                self.prm_bias
                + (0.5 if correct else -0.5) * self.prm_separation
                + rng.gauss(0.0, self.prm_branch_noise)
            )
            checks = math.ceil(min(length, self.max_tokens) / interval)
            rewards = tuple(
                _sigmoid(
                    self.prm_bias
                    + (1.0 - math.exp(-(j + 1) * interval / self.prm_warmup))
                    * (quality - self.prm_bias)
                    + rng.gauss(0.0, self.prm_noise)
                )
                for j in range(checks)
            )
            final = _sigmoid(quality + rng.gauss(0.0, self.prm_noise / 2))
            branches.append(
                BranchScript(
                    length=length, answer=answer, rewards=rewards, final_reward=final, filler=""
                )
            )
        return TraceRequest(
            id=rid,
            arrival=round(arrival, 6),
            answer=gold,
            branches=tuple(branches),
            prompt_tokens=self.prompt_tokens,
            interval=interval,
        )

    def _labels(self, rng: random.Random) -> list[str]:
        """Gold answer first, then the wrong ones."""
        if self.answers:
            labels = list(self.answers)
            rng.shuffle(labels)
            return labels[: self.wrong_answers + 1]
        values = rng.sample(range(1, 1000), self.wrong_answers + 1)
        return [str(v) for v in values]


#: GAOKAO-like: open-ended math/science answers, responses of a few thousand tokens.
GAOKAO = WorkloadModel(
    name="gaokao",
    median_length=3500,
    request_sigma=0.35,
    branch_sigma=0.34,
    difficulty_length=0.6,
    max_tokens=16384,
    accuracy=0.7,
    accuracy_concentration=2.0,
    wrong_answers=6,
    wrong_concentration=0.5,
    prompt_tokens=300,
    prm_bias=0.4,
    prm_separation=1.0,
    prm_branch_noise=1.0,
    prm_noise=0.6,
    prm_warmup=2000,
    sigma_spread=0.3,
    overthink=0.07,
    loop_share=0.08,
)

#: GPQA-like: four-choice science questions, longer reasoning, lower accuracy. The
#: fields it does not name (the token cap, the PRM's separation and per-branch noise,
#: the spread and overthinking of branches) are GAOKAO's.
GPQA = attrs.evolve(
    GAOKAO,
    name="gpqa",
    median_length=6000,
    request_sigma=0.3,
    branch_sigma=0.38,
    difficulty_length=0.5,
    accuracy=0.55,
    wrong_answers=3,
    wrong_concentration=1.0,
    prompt_tokens=450,
    prm_bias=0.2,
    prm_noise=0.7,
    prm_warmup=3000,
    answers=("A", "B", "C", "D"),
    loop_share=0.04,
)

WORKLOADS: dict[str, WorkloadModel] = {"gaokao": GAOKAO, "gpqa": GPQA}


def workload(name: str) -> WorkloadModel | ResampledWorkload:
    """A workload preset by name, or the workload resampled from a recorded trace file
    (``sart.bench.resample``)."""
    if name not in WORKLOADS and is_trace_file(name):
        if not Path(name).is_file():
            raise ConfigError(f"workload={name!r}: no such trace file")
        return load_resampled(name)
    return preset(WORKLOADS, name, "workload")
