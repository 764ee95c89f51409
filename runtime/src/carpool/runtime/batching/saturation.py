"""How near this pod runs to its latency objective, as one number: `carpool_slo_saturation`, 1.0 at the
objective. Pure: every call takes the time (`now`) from the engine, as the scheduler does.

The autoscaler (an HPA `type: Pods` metric with `averageValue: 1`, or KEDA) sizes the replica count as
`ceil(sum over pods of saturation)`. So the number must be proportional to load: twice the arrivals, twice
the saturation. Predicted latency over the objective is not (it is flat, then infinite near capacity),
and would make the HPA add far too few pods, then far too many. This module reports instead the arrival
rate over the largest rate at which the objective still holds (`rate_term`), and, where a backlog has
built that the arrival rate does not explain (closed-loop clients send at the pod's throughput however
many they are; an overload that has passed leaves work stranded on a pod), the time to clear it over the
objective, at most 2 (`queue_term`); the larger of the two, smoothed (up fast, down slow).

The largest rate comes from a service-time model fitted to the pod's own batches, `t(n) = fixed +
per_token * tokens`, and the dynamic batcher's fluid behaviour: while busy it runs batches back to back,
and a batch carries what arrived during the previous one. An input arriving at rate `rate` with `work`
tokens each then rides in batches of `tokens = rate * t * work`, so `t = fixed / (1 - rate * per_token *
work)`. Its latency is the rest of the batch running when it arrives (uniform over `[0, t]`: arrivals do
not see the batch cycle) plus its own batch: between `t` and `2t`, and its q-quantile `(1 + q) * t`. The
objective "p90 latency <= L" holds while `t <= L / 1.9`, which gives the largest rate
`(1 - fixed / t_max) / (per_token * work)`, capped by what the batcher can carry at all (its batch size
and token budget, with headroom: at full capacity random arrivals queue without bound).

Continuous batching (generation) has the same shape for time to first token: a step carries the prompt
of each new sequence and one token of each running one (`rate * t * decode_steps` of them, by Little's
law), so a request is `prompt + decode_steps` tokens of work, and a new sequence waits for the running
step, then runs its prefill: TTFT's q-quantile is again `(1 + q) * t`.

A pod still loading or warming up reports 0 (the engine sets it so from the first scrape): it carries no
load. The HPA reads a Pods metric from every pod, not-ready ones included (only CPU is special-cased),
and sizes `ceil(sum / 1)`, so a warming pod adds its replica to the count without adding to the sum: the
capacity on its way is counted, and the HPA does not add more pods for the same load while it warms.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from carpool.runtime.config import ObjectiveConfig

HEADROOM = 0.9
"""The share of the batcher's full capacity a pod may run at: at 100% a random arrival stream's queue
grows without bound."""

RISE_SHARE = 0.2
"""The smoothing's time constant while the signal rises, as a share of `smoothing_s`."""

QUEUE_TERM_CAP = 2.0
"""The most the queue alone may read: double the pods (as the HPA's default policy allows per period)."""

MIN_UPDATE_S = 0.05
"""The shortest time between two evaluations (the engine publishes its gauges every loop turn)."""

HPA_PERIOD_S = 15.0
"""kube-controller-manager's default `--horizontal-pod-autoscaler-sync-period`."""

MIN_WINDOW_S = 1.0
"""The shortest time an arrival rate is averaged over (right after start)."""

STEP_WINDOW_S = 2.0
"""The recent window in which a step up of the arrival rate is looked for (at most half the horizon)."""

STEP_SIGMAS = 3.0
"""How far above the horizon's rate (in standard deviations of a Poisson count) the recent window's count
must be to count as a step: a steady stream passes it in a fraction of a percent of windows, and the
signal's smoothing absorbs one."""


@dataclass(frozen=True)
class Objective:
    """A latency objective: the `percentile` (a fraction, 0.9 for p90) of latency at most `latency_s`."""

    latency_s: float
    percentile: float

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile < 1.0:
            raise ValueError(f"percentile {self.percentile} must lie strictly between 0 and 1")
        if self.latency_s <= 0.0:
            raise ValueError(f"latency_s {self.latency_s} must be positive")

    @property
    def batch_budget_s(self) -> float:
        """The longest batch (or step) time at which the objective holds: latency's q-quantile is
        `(1 + q)` batch times (the rest of the running batch, then its own)."""
        return self.latency_s / (1.0 + self.percentile)


@dataclass(frozen=True)
class BatchLimits:
    """What one batch (or step) may carry, and how many run at once."""

    max_items: int
    """Inputs per batch (encoders), or running sequences (generation)."""
    max_tokens: int
    """Tokens per batch (encoders), or per step (generation)."""
    instances: int = 1
    """Batches that run at once (`model.instances`)."""


class ServiceModel:
    """Batch time against its tokens, `seconds = fixed + per_token * tokens`, by least squares over the
    last `window` served batches once they span shapes enough to give a slope; until then (a pod just
    ready, or a load whose batches are all alike) over those and the warm-up's batches, which span the
    configured shapes. The served ones win as soon as they can: a warm-up's first batches are often
    slow for reasons that never recur (lazy initialisation, graph capture)."""

    MIN_SERVED = 16
    MIN_SPREAD = 0.1
    """The coefficient of variation of batch tokens under which a slope is not trusted."""

    def __init__(self, window: int = 256) -> None:
        self._pinned: list[tuple[float, float]] = []
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)

    def record(self, tokens: int, seconds: float, *, pinned: bool = False) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        (self._pinned.append if pinned else self._recent.append)((float(tokens), seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any batch."""
        if len(self._recent) >= self.MIN_SERVED and (line := _line(list(self._recent))) is not None:
            return line
        points = self._pinned + list(self._recent)
        if not points:
            return None
        line = _line(points)
        if line is not None:
            return line
        # One batch shape only, or noise that bends the line the wrong way: all cost per token, which
        # overstates small batches and so errs towards more replicas.
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares through `points`, or None where their tokens barely vary or the line is not a
    cost (negative slope or intercept)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if n < 2 or sxx < (ServiceModel.MIN_SPREAD * mx) ** 2 * n:
        return None
    per_token = sum((x - mx) * (y - my) for x, y in points) / sxx
    fixed = my - per_token * mx
    if per_token <= 0 or fixed < 0:
        return None
    return fixed, per_token


class ArrivalMeter:
    """Requests and their tokens per second over the last `horizon_s`, in buckets (memory does not grow
    with the rate)."""

    def __init__(self, horizon_s: float, buckets: int = 20) -> None:
        self.horizon_s = horizon_s
        self._width = horizon_s / buckets
        self._buckets: deque[list[float]] = deque()  # [start, requests, tokens]
        self._since: float | None = None

    def start(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def record(self, now: float, requests: int, tokens: int) -> None:
        self.start(now)
        if self._buckets and now - self._buckets[-1][0] < self._width:
            self._buckets[-1][1] += requests
            self._buckets[-1][2] += tokens
        else:
            self._buckets.append([now, float(requests), float(tokens)])

    def _evict(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] < now - 2 * self.horizon_s:  # two: for the trend
            self._buckets.popleft()

    def _recent(self, now: float) -> list[list[float]]:
        self._evict(now)
        return [b for b in self._buckets if b[0] >= now - self.horizon_s]

    def rate(self, now: float) -> float:
        """Requests per second: over the horizon, or over the last `STEP_WINDOW_S` when a step up shows
        there (more arrivals than the horizon's rate explains, by `STEP_SIGMAS` standard deviations of a
        Poisson count): averaged over 10 s, a load that jumped 5 s ago reads half of what it is, and the
        pods added for it come one HPA period later."""
        if self._since is None:
            return 0.0
        recent = self._recent(now)
        window = max(MIN_WINDOW_S, min(self.horizon_s, now - self._since))
        rate = sum(b[1] for b in recent) / window
        if now - self._since < self.horizon_s:
            return rate  # the horizon's own window is still as short as the start
        short = min(STEP_WINDOW_S, self.horizon_s / 2)
        latest = [b for b in recent if b[0] >= now - short]
        if not latest:
            return rate
        # The buckets counted hold the arrivals since the first one's start (one bucket's width after
        # `now - short` at most): that is the window, and no less than `short` less a width.
        span = max(short - self._width, now - latest[0][0])
        count = sum(b[1] for b in latest)
        expected = rate * span
        if count > expected + STEP_SIGMAS * math.sqrt(max(expected, 1.0)):
            return count / span
        return rate

    def previous_rate(self, now: float) -> float | None:
        """Requests per second over the horizon before the last one (None before two have passed)."""
        if self._since is None or now - self._since < 2 * self.horizon_s:
            return None
        self._evict(now)
        return sum(b[1] for b in self._buckets if b[0] < now - self.horizon_s) / self.horizon_s

    def tokens_per_request(self, now: float) -> float | None:
        recent = self._recent(now)
        requests = sum(b[1] for b in recent)
        return sum(b[2] for b in recent) / requests if requests else None


@dataclass(frozen=True)
class Reading:
    """One evaluation, with its parts (for logs, tests and the README's explanation)."""

    saturation: float
    """The smoothed signal the pod exports."""
    raw: float
    rate: float
    """Requests per second arriving."""
    sustainable_rate: float | None
    """The largest rate at which the objective holds (None before the first batch)."""
    queue_term: float
    reachable: bool
    """False when even a batch of one input takes longer than the objective allows."""


class SaturationEstimator:
    """Turns batches, arrivals and the queue's backlog into the saturation signal.

    Call order (the engine): `warmup_batch` for each warm-up batch; then, serving, `arrive` on each
    admitted request, `batch` after each batch or step, `finished` with the decode steps of each finished
    sequence (generation only), and `update` whenever the gauges are published.
    """

    def __init__(
        self,
        objective: Objective,
        limits: BatchLimits,
        *,
        horizon_s: float = 10.0,
        smoothing_s: float = 10.0,
        generation: bool = False,
        lead_s: float = 0.0,
    ) -> None:
        self.objective = objective
        self.lead_s = lead_s
        """How far ahead a rising arrival rate is extrapolated: what a new pod takes to serve (the HPA's
        period and this pod's own start-up, which the engine measures)."""
        self.limits = limits
        self.smoothing_s = smoothing_s
        self.generation = generation
        self.service = ServiceModel()
        self.arrivals = ArrivalMeter(horizon_s)
        self._steps: deque[int] = deque(maxlen=256)
        self._value = 0.0
        self._updated: float | None = None
        self._last: Reading | None = None

    @property
    def value(self) -> float:
        return self._value

    def warmup_batch(self, tokens: int, seconds: float) -> None:
        self.service.record(tokens, seconds, pinned=True)

    def batch(self, tokens: int, seconds: float) -> None:
        self.service.record(tokens, seconds)

    def arrive(self, now: float, requests: int, tokens: int) -> None:
        self.arrivals.record(now, requests, tokens)

    def finished(self, decode_steps: int) -> None:
        if decode_steps > 0:
            self._steps.append(decode_steps)

    def sustainable_rate(self, now: float) -> tuple[float | None, bool]:
        """Requests per second at which the objective's percentile just holds, and whether the objective
        can hold at all (a batch of one fits the budget)."""
        rates = self._rates(now)
        return (None, True) if rates is None else (rates[0], rates[2])

    def _rates(self, now: float) -> tuple[float, float, bool] | None:
        """(sustainable rate, full capacity, reachable), or None before the first batch and arrival."""
        fit = self.service.fit()
        prompt = self.arrivals.tokens_per_request(now)
        if fit is None or prompt is None:
            return None
        fixed, per_token = fit
        steps = sum(self._steps) / len(self._steps) if (self.generation and self._steps) else 1.0
        work = prompt + steps if self.generation else prompt
        # The batcher's own ceiling: concurrency `items` (each request occupies a slot for `steps`
        # batches), or what the token budget lets in, whichever binds first.
        items = min(float(self.limits.max_items), self.limits.max_tokens * steps / work)
        full = items / (steps * (fixed + per_token * items * work / steps)) * self.limits.instances
        budget = self.objective.batch_budget_s
        reachable = budget > fixed + per_token * work / steps
        if not reachable:
            # No replica count meets it; size for throughput alone (the README says so).
            return HEADROOM * full, full, False
        latency_bound = (1.0 - fixed / budget) / (per_token * work) * self.limits.instances
        return min(latency_bound, HEADROOM * full), full, True

    def evaluate(self, now: float, backlog_s: float) -> Reading:
        """The raw signal now, unsmoothed: `backlog_s` is the scheduler's queued work in seconds."""
        self.arrivals.start(now)
        rate = self.arrivals.rate(now)
        rates = self._rates(now)
        if rates is None:
            return Reading(self._value, 0.0, rate, None, 0.0, True)
        sustainable, full, reachable = rates
        # A rising load is sized for where it will be when pods added now can serve (pods added for the
        # load of now serve a load that has moved on); a falling one for now (the HPA's scale-down
        # window waits anyway).
        previous = self.arrivals.previous_rate(now)
        ahead = rate
        if previous is not None and rate > previous and self.lead_s > 0:
            ahead = rate + (rate - previous) * self.lead_s / self.arrivals.horizon_s
        rate_term = ahead / sustainable
        # A backlog past the objective means requests there miss it, and the arrival rate does not
        # always show why: closed-loop clients send at the pod's throughput however many they are (N of
        # them queued on a pod wait N / throughput, so the time to clear the backlog over the objective
        # is the factor of pods missing), and work an overload has stranded on a pod drains only as fast
        # as other pods take arrivals off it (connections spread at random). But a pod cannot tell the
        # two apart, so the queue may ask for twice the pods at most per reading, as the HPA's default
        # policy allows per period; the next reading sees what the new pods did. Above capacity
        # (open-loop overload) the arrival rate tells the demand itself.
        queue_term = 0.0
        if rate <= full / HEADROOM:
            queue_term = min(backlog_s / self.objective.latency_s, QUEUE_TERM_CAP)
        raw = max(rate_term, queue_term)
        return Reading(self._value, raw, rate, sustainable, queue_term, reachable)

    def update(self, now: float, backlog_s: float) -> Reading:
        """Evaluate and fold into the smoothed value (an exponential average with time constant
        `smoothing_s`: one busy second does not add a pod, a sustained change does within seconds)."""
        if self._last is not None and self._updated is not None and now - self._updated < MIN_UPDATE_S:
            return self._last  # a GPU's loop turns thousands of times a second; 20 readings a second do
        reading = self.evaluate(now, backlog_s)
        if self._updated is None:
            self._value = reading.raw
        else:
            # Up fast, down slow: a rise in load is acted on within seconds (the arrival rate's own
            # horizon already averages out bursts), a fall only once it lasts.
            tau = self.smoothing_s * (RISE_SHARE if reading.raw > self._value else 1.0)
            weight = 1.0 - math.exp(-max(0.0, now - self._updated) / tau)
            self._value += weight * (reading.raw - self._value)
        self._updated = now
        self._last = Reading(
            self._value,
            reading.raw,
            reading.rate,
            reading.sustainable_rate,
            reading.queue_term,
            reading.reachable,
        )
        return self._last


def objective_estimator(
    config: ObjectiveConfig, limits: BatchLimits, *, generation: bool
) -> SaturationEstimator | None:
    """The estimator for `objective` in the runtime config, or None when no objective is set."""
    if config.latency_s is None:
        return None
    return SaturationEstimator(
        Objective(config.latency_s, config.percentile / 100.0),
        limits,
        horizon_s=config.horizon_s,
        smoothing_s=config.smoothing_s,
        generation=generation,
        lead_s=config.lead_s or 0.0,
    )
