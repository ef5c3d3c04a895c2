"""The GPU harness's reading of the gate's wait histograms (`tests/gpu_waits.py`)."""

from __future__ import annotations

from tests.gpu_waits import wait_summary

A = "vllm_supervisor_client_admission_wait_seconds"


def lines(n1: float, n5: float, n_inf: float, total: float) -> dict[str, float]:
    """One model's admission waits: cumulative buckets up to 1, 5 and +Inf seconds."""
    return {f'{A}_bucket{{le="1.0",model="m"}}': n1, f'{A}_bucket{{le="5.0",model="m"}}': n5,
            f'{A}_bucket{{le="+Inf",model="m"}}': n_inf, f'{A}_count{{model="m"}}': n_inf,
            f'{A}_sum{{model="m"}}': total}


def test_only_the_waits_between_the_two_reads_count() -> None:
    before = lines(10, 10, 10, 2.0)  # ten short waits before the run
    after = lines(10 + 90, 10 + 99, 10 + 100, 2.0 + 150.0)
    s = wait_summary(before, after)[A.removeprefix("vllm_supervisor_")]
    assert s == {"count": 100, "mean_s": 1.5, "p50_le_s": 1.0, "p99_le_s": 5.0,
                 "max_le_s": None}  # (one past the last finite bound: not bounded)


def test_a_family_nobody_waited_in_says_so_and_label_sets_add_up() -> None:
    after = {**lines(1, 2, 2, 3.0),
             **{k.replace('model="m"', 'model="n"'): v for k, v in lines(0, 2, 2, 5.0).items()}}
    s = wait_summary({}, after)
    assert s["client_admission_wait_seconds"] == {
        "count": 4, "mean_s": 2.0, "p50_le_s": 5.0, "p99_le_s": 5.0, "max_le_s": 5.0}
    assert s["client_hold_wait_seconds"] == {"count": 0}
    assert s["client_continuation_gap_seconds"] == {"count": 0}
