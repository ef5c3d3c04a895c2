"""The watchdog's judgement: `decide(signals, state, config, now) -> PolicyDecision`.

Pure: no I/O, no logging, no clock. Everything the policy remembers between calls (when
each rule's condition started to hold, throttle levels a rule holds, cooldowns, the
restarts it caused in the last hour) lives in `PolicyMemory`, passed in with the state
and returned, changed, in the decision. The daemon stores it and carries the action out
(or only logs it, in dry-run).

Per rule (see `rules.py`): the condition must hold `for_s` on a serving engine (without
a break, or, for a windowed rule, in at least `for_fraction` of the samples over the
last `for_s`, the window covered and the condition true now); the rule acts, then waits
`cooldown_s` before acting again. A one-shot rule (restart, alert...) is disarmed when
it acts and re-armed once its clear condition has held `clear_for_s` (hysteresis: the
same symptom does not fire twice without clearing in between) or a new engine starts. A
throttle rule steps one level per cooldown while its condition holds, escalates when it
still holds `escalate_after_s` after reaching the top level (and its `escalate_when`, the
evidence that the next rung can cure it, holds then: else it stays there and says why
once), and lifts one step per `clear_for_s` of its clear condition.

The remediation ladder (`rules.LADDER`): every remedy is a rung, taken only when the
operator allows it (`policy.remedies`) and the engine supports it (a prefix-cache reset
needs VLLM_SERVER_DEV_MODE; a KV reset needs sleep mode and the front proxy); otherwise
the next rung up. A symptom that outlives its remedy without clearing climbs: after an
in-place remedy (prefix-cache or KV reset) the rule stays armed and its next firing takes
the next rung; after a restart the new engine re-arms it, and if the symptom persists
there too, the next rung again; a throttle rule's escalations climb the same way. The
top rung is an alert: the policy gives up on that symptom until it clears.

Guardrails, in order: an escalation's evidence (`escalate_when`), pause (maintenance),
the restart budget (past it: one alert, then nothing), the minimum gap between actions
(a frozen engine's restart and a hold-down skip it), a KV reset's wait for a silent API
server (up to SILENT_HOLD_MAX_S; other actions due go meanwhile), the per-rule cooldown,
dry-run (decided, audited, not done).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from supervisor.watchdog.conditions import Condition, parse_condition
from supervisor.watchdog.rules import IN_PLACE, LADDER, LIFTABLE, RuleConfig
from supervisor.watchdog.signal_list import SIGNAL_NAMES

# A due kv_reset waits at most this long for a silent API server (`EngineFacts.api_silent`)
# to answer a scrape: a blocked event loop held a GPU test's pause 14 s (docs/watchdog.md).
# Past it the reset goes as before: a server that never answers again is for the pause's
# timeout, and the ladder's restart after it, to judge.
SILENT_HOLD_MAX_S = 60.0

# Several rules may be due at once; one action per decision, the most drastic first.
PRIORITY = ("hold_down", "restart_now", "restart", "reduce_batch", "kv_reset", "throttle",
            "fewer_spec_tokens", "more_spec_tokens", "reset_prefix_cache", "lift", "alert")
HOUR_S = 3600.0


@dataclass(frozen=True)
class RuleMemory:
    true_since: float | None = None  # the condition has held since (serving engine)
    clear_since: float | None = None  # the clear condition has held since
    armed: bool = True  # one-shot rules: may act (again)
    levels: int = 0  # throttle levels this rule holds
    reduced: bool = False  # this rule holds the reduced batch
    top_since: float | None = None  # held at the top throttle level since
    last_fired: float | None = None
    trips: int = 0
    generation: int = 0  # the engine the timers and the arming refer to
    rung: str = ""  # the last ladder rung taken for the symptom since it last cleared
    # windowed rules (for_fraction < 1): (time, condition held) over the last for_s, and
    # since when this engine has been judged (the window must be covered)
    samples: tuple[tuple[float, bool], ...] = ()
    judged_since: float | None = None


@dataclass(frozen=True)
class PolicyMemory:
    rules: Mapping[str, RuleMemory] = field(default_factory=dict)
    restarts: tuple[float, ...] = ()  # engine restarts the policy caused, last hour
    last_action_at: float | None = None
    budget_alerted: bool = False
    last_note: tuple[str, str] | None = None  # (rule, why held back), reported once
    # since when a due kv_reset has waited for a silent API server (None: none waits)
    silent_since: float | None = None


class PolicySettings(Protocol):
    """What the policy reads of `[policy]` (`supervisor.settings.sections.PolicyConfig`)."""

    @property
    def dry_run(self) -> bool: ...
    @property
    def max_restarts_per_hour(self) -> int: ...
    @property
    def min_action_gap_s(self) -> float: ...
    @property
    def remedies(self) -> list[str]: ...
    @property
    def rules(self) -> dict[str, RuleConfig]: ...


@dataclass(frozen=True)
class EngineFacts:
    """What the policy needs to know of the engine and of the remedies it allows."""

    state: str = "RUNNING"
    generation: int = 1  # changes with every engine start
    throttle_level: int = 0
    max_throttle_level: int = 3
    batch_reduced: bool = False
    spec_tokens: int | None = None  # num_speculative_tokens in force; None: no spec decode
    spec_tokens_max: int = 0
    can_reset_prefix_cache: bool = False  # VLLM_SERVER_DEV_MODE=1 and its route served
    can_kv_reset: bool = False  # sleep mode and its endpoints, requests held at the proxy
    live_throttle: bool = False  # admission control in front: throttling needs no restart
    # why the engine's API server is taken for silent now (None: it answered its last
    # scrape): a KV reset's pause waits for it to answer, holding every request meanwhile
    api_silent: str | None = None
    # why an in-place rung the engine lacks is off (its probe's word: a route not
    # served, a flag missing), named when the ladder skips it; else the general reason
    why_off: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyState:
    engine: EngineFacts
    memory: PolicyMemory = field(default_factory=PolicyMemory)
    paused: bool = False


@dataclass(frozen=True)
class PolicyDecision:
    action: str  # "none", "lift" or one of rules.ACTIONS
    memory: PolicyMemory
    rule: str | None = None
    reason: str = ""
    evidence: Mapping[str, float | None] = field(default_factory=dict)
    throttle_level: int = 0  # in force after this decision
    batch_reduced: bool = False
    spec_tokens: int | None = None
    restarts_engine: bool = False
    dry_run: bool = False
    held_back: str | None = None  # a due action not taken, and why (reported once)


@functools.lru_cache(maxsize=256)
def _cond(text: str) -> Condition:
    return parse_condition(text, SIGNAL_NAMES)


@dataclass(frozen=True)
class _Due:
    rule: str
    action: str
    reason: str
    evidence: dict[str, float | None]
    # why it may not go now though due (an escalation without its evidence); None: it may
    unproven: str | None = None


def _evidence(signals: Mapping[str, float | None], *texts: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for t in texts:
        if t:
            for name in _cond(t).signals:
                v = signals.get(name)
                out[name] = round(v, 6) if v is not None else None
    return out


_UNSUPPORTED = {
    "reset_prefix_cache": "the engine has no /reset_prefix_cache: VLLM_SERVER_DEV_MODE is off",
    "kv_reset": "the engine cannot drop its KV cache in place (it needs --enable-sleep-mode, "
                "VLLM_SERVER_DEV_MODE=1 and the front proxy)",
    "throttle": "already at the top throttle level",
    "reduce_batch": "the batch is already reduced",
}


def _supported(rung: str, e: EngineFacts) -> bool:
    if rung == "reset_prefix_cache":
        return e.can_reset_prefix_cache
    if rung == "kv_reset":
        return e.can_kv_reset
    if rung == "throttle":
        return e.throttle_level < e.max_throttle_level
    if rung == "reduce_batch":
        return not e.batch_reduced
    return True


def _rung(want: str, e: EngineFacts, allowed: tuple[str, ...]) -> tuple[str, str]:
    """The rung taken for `want`, and why any rung below it was skipped ("" if none):
    `want` itself when allowed and supported, else the next one up that is (throttle only
    when asked for by name: only a throttle rule throttles), "alert" at the top. Actions
    off the ladder (restart_now, hold_down, the speculative-token steps) stand as they are."""
    if want not in LADDER:
        return want, ""
    skipped: list[str] = []
    for rung in LADDER[LADDER.index(want):]:
        if rung == "alert":
            break
        if rung == "throttle" and want != "throttle":
            continue
        if rung not in allowed:
            skipped.append(f"{rung}: not in policy.remedies")
        elif not _supported(rung, e):
            skipped.append(f"{rung}: {e.why_off.get(rung) or _UNSUPPORTED[rung]}")
        else:
            return rung, "; ".join(skipped)
    return "alert", "; ".join(skipped)


def _climb(last: str) -> str:
    """The rung above `last` (where a symptom that outlived `last` goes next); never
    throttle, which only a throttle rule takes, as its first rung."""
    above = [r for r in LADDER[LADDER.index(last) + 1:] if r != "throttle"]
    return above[0] if above else "alert"


def _step_rule(name: str, rule: RuleConfig, m: RuleMemory, signals: Mapping[str, float | None],
               e: EngineFacts, now: float,
               allowed: tuple[str, ...]) -> tuple[RuleMemory, _Due | None]:
    if m.generation != e.generation:
        # A new engine: its condition must hold on it from now, and a symptom of this
        # engine is a new occurrence (one-shot rules re-arm; the cooldowns and the restart
        # budget still bound how often they act).
        m = dataclasses.replace(m, true_since=None, clear_since=None, top_since=None,
                                armed=True, generation=e.generation, samples=(),
                                judged_since=None)
    cond = _cond(rule.when).holds(signals)
    # clear: the clear condition holds and the trip condition does not (a card reporting
    # thermal slowdown is not cool, whatever its temperature reads)
    clear = not cond and (_cond(rule.clear_when).holds(signals) if rule.clear_when else True)
    true_since = (now if m.true_since is None else m.true_since) if cond else None
    clear_since = (now if m.clear_since is None else m.clear_since) if clear else None
    m = dataclasses.replace(m, true_since=true_since, clear_since=clear_since)
    cleared = clear_since is not None and now - clear_since >= rule.clear_for_s
    if cleared and not m.armed:
        m = dataclasses.replace(m, armed=True)
    if m.rung and clear_since is not None and now - clear_since >= max(rule.clear_for_s,
                                                                       rule.for_s):
        # The symptom is gone, for as long as it had to last to trip: a new one starts at
        # the bottom of the ladder again. (Not sooner: one scrape that leaves a signal
        # unknown reads as clear, and must not send a symptom that outlived its remedy
        # back to that remedy.)
        m = dataclasses.replace(m, rung="")
    if not cond:
        m = dataclasses.replace(m, top_since=None)
    if rule.for_fraction < 1.0:
        m = _sampled(m, cond, now, rule.for_s)
        held = cond and _window_holds(m, now, rule)
    else:
        held = true_since is not None and now - true_since >= rule.for_s
    cooled = m.last_fired is None or now - m.last_fired >= rule.cooldown_s
    ev = _evidence(signals, rule.when, rule.clear_when)
    why = f"{name}: {rule.when} for {rule.for_s:g} s"
    if rule.for_fraction < 1.0:
        share = window_share(m) or 0.0
        why = (f"{name}: {rule.when} in {share:.0%} of the samples over {rule.for_s:g} s "
               f"(at least {rule.for_fraction:.0%})")

    if rule.action in LIFTABLE:
        if held:
            # (a rung the operator does not allow counts as exhausted: straight to the wait
            # for escalation)
            if rule.action in allowed and _supported(rule.action, e) and not m.rung:
                return m, _Due(name, rule.action, why, ev) if cooled else None
            top_since = m.top_since if m.top_since is not None else now
            m = dataclasses.replace(m, top_since=top_since)
            if (rule.escalate_after_s and now - top_since >= rule.escalate_after_s and cooled
                    and m.rung != "alert"):
                want = _climb(m.rung) if m.rung else rule.escalate_action
                esc, skipped = _rung(want, e, allowed)
                unproven = None
                if rule.escalate_when:  # (its evidence, named either way)
                    ev = {**ev, **_evidence(signals, rule.escalate_when)}
                    if not _cond(rule.escalate_when).holds(signals):
                        unproven = (f"it needs {rule.escalate_when}, which does not hold: "
                                    f"nothing says {esc} would cure it")
                return m, _Due(name, esc, f"{name}: still {rule.when} after "
                               f"{now - top_since:.0f} s at the top throttle level"
                               + (f" (skipped {skipped})" if skipped else ""), ev, unproven)
            return m, None
        if clear_since is not None and cleared and (m.levels > 0 or m.reduced) and (
                m.last_fired is None or now - m.last_fired >= rule.clear_for_s):
            cev = _evidence(signals, rule.clear_when or rule.when)
            what = rule.clear_when or f"not ({rule.when})"
            return m, _Due(name, "lift", f"{name}: {what} for {now - clear_since:.0f} s", cev)
        return m, None

    if (m.reduced and clear_since is not None
            and now - clear_since >= max(rule.clear_for_s, rule.cooldown_s)):
        # a one-shot rule that climbed to the reduced batch restores it once its symptom
        # has been gone a cooldown (at least): the relaunch is not repeated at once
        cev = _evidence(signals, rule.clear_when or rule.when)
        return m, _Due(name, "lift", f"{name}: not ({rule.when}) for "
                       f"{now - clear_since:.0f} s", cev)
    if not (held and m.armed and cooled) or m.rung == "alert":
        return m, None
    if m.rung:
        why = f"{name}: still {rule.when} after {m.rung}"
    action, skipped = _rung(_climb(m.rung) if m.rung else rule.action, e, allowed)
    if skipped:
        why += f" (skipped {skipped})"
    if action == "fewer_spec_tokens" and not e.spec_tokens:
        return m, None
    if action == "more_spec_tokens" and (e.spec_tokens is None
                                         or e.spec_tokens >= e.spec_tokens_max):
        return m, None
    return m, _Due(name, action, why, ev)


def _sampled(m: RuleMemory, cond: bool, now: float, for_s: float) -> RuleMemory:
    kept = tuple(x for x in m.samples if x[0] > now - for_s)
    since = m.judged_since if m.judged_since is not None else now
    return dataclasses.replace(m, samples=(*kept, (now, cond)), judged_since=since)


def window_share(m: RuleMemory) -> float | None:
    """The share of a windowed rule's samples in which its condition held (None: none)."""
    if not m.samples:
        return None
    return sum(1 for _, ok in m.samples if ok) / len(m.samples)


def _window_holds(m: RuleMemory, now: float, rule: RuleConfig) -> bool:
    share = window_share(m)
    return (m.judged_since is not None and now - m.judged_since >= rule.for_s
            and share is not None and share >= rule.for_fraction)


def _restarts(action: str, e: EngineFacts, lifts_batch: bool = False) -> bool:
    if action in ("restart", "restart_now", "reduce_batch", "fewer_spec_tokens",
                  "more_spec_tokens"):
        return True
    if action == "lift":
        # restoring the batch is a relaunch; restoring admission limits is one only
        # without a live throttle
        return lifts_batch or not e.live_throttle
    return action == "throttle" and not e.live_throttle


def decide(signals: Mapping[str, float | None], state: PolicyState, config: PolicySettings,
           now: float) -> PolicyDecision:
    e = state.engine
    mem = state.memory
    rules = dict(mem.rules)
    restarts = tuple(t for t in mem.restarts if now - t < HOUR_S)

    def unchanged(memory: PolicyMemory, **kw: object) -> PolicyDecision:
        return PolicyDecision("none", memory, throttle_level=e.throttle_level,
                        batch_reduced=e.batch_reduced, spec_tokens=e.spec_tokens,
                        dry_run=config.dry_run, **kw)  # type: ignore[arg-type]

    if e.state != "RUNNING":
        # A condition must hold on a serving engine: timers start again when it serves.
        for name, m in rules.items():
            rules[name] = dataclasses.replace(m, true_since=None, clear_since=None,
                                              top_since=None, samples=(), judged_since=None)
        return unchanged(dataclasses.replace(mem, rules=rules, restarts=restarts,
                                             silent_since=None))

    due: list[_Due] = []
    for name, rule in config.rules.items():
        if not rule.enabled:
            continue
        m, d = _step_rule(name, rule, rules.get(name, RuleMemory()), signals, e, now,
                          tuple(config.remedies))
        rules[name] = m
        if d is not None:
            due.append(d)
    budget_left = len(restarts) < config.max_restarts_per_hour
    mem = dataclasses.replace(mem, rules=rules, restarts=restarts,
                              budget_alerted=mem.budget_alerted and not budget_left)
    if not due:
        return unchanged(dataclasses.replace(mem, last_note=None, silent_since=None))
    # A KV reset pauses the engine through its API server: while that server is silent it
    # waits (held back below), up to SILENT_HOLD_MAX_S, and whatever else is due goes
    # meanwhile.
    waits = e.api_silent is not None and any(x.action == "kv_reset" and x.unproven is None
                                             for x in due)
    since = (now if mem.silent_since is None else mem.silent_since) if waits else None
    mem = dataclasses.replace(mem, silent_since=since)
    holding = since is not None and now - since < SILENT_HOLD_MAX_S
    if holding and any(x.action != "kv_reset" for x in due):
        due = [x for x in due if x.action != "kv_reset"]
    # (an escalation without its evidence never goes; whatever else is due goes instead)
    due = [x for x in due if x.unproven is None] or due
    d = min(due, key=lambda x: PRIORITY.index(x.action))
    restarting = _restarts(d.action, e, rules[d.rule].reduced)

    def held_back(why: str) -> PolicyDecision:
        note = (d.rule, why)
        new = dataclasses.replace(mem, last_note=note)
        return unchanged(new, rule=d.rule, reason=d.reason, evidence=d.evidence,
                         held_back=None if mem.last_note == note
                         else f"{d.action} held back: {why}")

    if d.unproven is not None:
        return held_back(d.unproven)
    if state.paused:
        return held_back("the policy is paused")
    if restarting and not budget_left:
        if mem.budget_alerted:
            return held_back("restart budget exhausted")
        mem = dataclasses.replace(mem, budget_alerted=True, last_action_at=now)
        return PolicyDecision(
            "alert", mem, rule=d.rule, evidence=d.evidence,
            reason=(f"restart budget exhausted ({len(restarts)} policy restarts in the last "
                    f"hour, at most {config.max_restarts_per_hour}): not acting on "
                    f"{d.action} for {d.reason}"), throttle_level=e.throttle_level,
            batch_reduced=e.batch_reduced, spec_tokens=e.spec_tokens, dry_run=config.dry_run)
    urgent = d.action in ("restart_now", "hold_down")
    if (not urgent and mem.last_action_at is not None
            and now - mem.last_action_at < config.min_action_gap_s):
        return held_back(f"less than {config.min_action_gap_s:g} s since the last action")
    if d.action == "kv_reset" and holding:
        # (a pause is a request to that server: begun while its event loop was blocked for
        # 10-20 s, a reset held its requests 14 s; docs/watchdog.md)
        return held_back(f"{e.api_silent}: its pause would hold every request until it "
                         f"answers (at most {SILENT_HOLD_MAX_S:g} s)")

    m = rules[d.rule]
    level, reduced, spec = e.throttle_level, e.batch_reduced, e.spec_tokens
    if d.action == "throttle":
        level += 1
        m = dataclasses.replace(m, levels=m.levels + (0 if config.dry_run else 1))
    elif d.action == "reduce_batch":
        reduced = True
        m = dataclasses.replace(m, reduced=not config.dry_run)
    elif d.action == "lift":
        if m.reduced:
            reduced = False
            m = dataclasses.replace(m, reduced=False)
        else:
            level = max(0, level - 1)
            m = dataclasses.replace(m, levels=m.levels - 1)
        m = dataclasses.replace(m, clear_since=now)  # the next step needs clear_for_s again
    elif d.action == "fewer_spec_tokens" and spec is not None:
        spec -= 1
    elif d.action == "more_spec_tokens" and spec is not None:
        spec += 1
    if d.action not in (*LIFTABLE, *IN_PLACE, "lift") and not config.dry_run:
        # (in dry-run the cooldown alone spaces the reports: nothing was done, so the
        # symptom is still there to report; after an in-place remedy the rule stays armed,
        # to climb if the symptom outlives it)
        m = dataclasses.replace(m, armed=False)
    own = config.rules[d.rule].action
    if d.action in LADDER and not config.dry_run and not (d.action == own and own in LIFTABLE):
        m = dataclasses.replace(m, rung=d.action)  # where the next climb starts from
    if own in LIFTABLE and d.action not in (own, "lift") and m.top_since is not None:
        m = dataclasses.replace(m, top_since=now)  # an escalation waits its time again
    m = dataclasses.replace(m, last_fired=now, trips=m.trips + 1)
    rules[d.rule] = m
    if restarting and not config.dry_run:
        restarts = (*restarts, now)
    if config.dry_run:
        level, reduced, spec = e.throttle_level, e.batch_reduced, e.spec_tokens
    mem = dataclasses.replace(mem, rules=rules, restarts=restarts, last_action_at=now,
                              last_note=None)
    return PolicyDecision(d.action, mem, rule=d.rule, reason=d.reason, evidence=d.evidence,
                    throttle_level=level, batch_reduced=reduced, spec_tokens=spec,
                    restarts_engine=restarting, dry_run=config.dry_run)

