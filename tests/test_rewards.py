"""Rewards: \\boxed{} extraction, exact-match normalisation, math-verify equivalence,
robustness to garbage, deadlines in the main thread and in other threads."""
import signal
import threading
import time

import pytest

from erpo import rewards
from erpo.rewards import (
    REWARDS,
    exact_match_reward,
    extract_answer,
    extract_boxed,
    get_reward_fn,
    math_verify_reward,
)


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("x = \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),                      # the last box wins
    ("\\boxed{\\boxed{3}}", "\\boxed{3}"),                          # a box inside a box is content
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                          # escaped braces do not count
    ("\\boxed {7}", "7"),
    ("\\boxed{5} and a truncated \\boxed{\\frac{1}{", "5"),        # unclosed last box is skipped
    ("\\boxed{}", ""),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["no box here: 42", "", "\\boxed{unclosed", "\\boxed", "boxed{3}"])
def test_extract_boxed_missing(text):
    assert extract_boxed(text) is None
    assert extract_answer(text) is None


@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{7}", "7", 1.0),
    ("\\boxed{07}", "7", 1.0),
    ("\\boxed{ 7 }", "007", 1.0),
    ("\\boxed{-07}", "-7", 1.0),
    ("\\boxed{+3}", "3", 1.0),
    ("\\boxed{2 x + 1}", "2x+1", 1.0),
    ("\\boxed{\\frac{1}{2}}", " \\frac{1}{2} ", 1.0),
    ("\\boxed{$5$}", "5", 1.0),
    ("\\boxed{8}", "7", 0.0),
    ("\\boxed{70}", "7", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),   # equivalence is math_verify's job
    ("7", "7", 0.0),                          # no box, no reward
    ("\\boxed{7} ... \\boxed{8}", "7", 0.0),  # only the last box counts
])
def test_exact_match(completion, answer, expected):
    assert exact_match_reward(completion, answer) == expected


@pytest.mark.parametrize("completion, answer", [
    ("so \\boxed{0.5}", "\\frac{1}{2}"),
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{1/2}", "\\frac12"),
    ("\\boxed{1+2x}", "2x+1"),
    ("\\boxed{2*x+1}", "1 + 2x"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{x=3}", "3"),
    ("\\boxed{07}", "7"),
    ("\\boxed{3}", "\\boxed{3}"),   # a boxed gold answer is unboxed
    ("\\boxed{3}", "$3$"),
])
def test_math_verify_equivalent(completion, answer):
    assert math_verify_reward(completion, answer) == 1.0


@pytest.mark.parametrize("completion, answer", [
    ("\\boxed{3}", "4"),
    ("\\boxed{0.49}", "\\frac{1}{2}"),
    ("\\boxed{2x-1}", "2x+1"),
    ("the answer is 0.5", "\\frac{1}{2}"),        # no box
    ("\\boxed{}", "1"),
    ("\\boxed{}{\\frac{}", "1"),                   # garbage inside the box
    ("\\boxed{\\sqrt{\\frac{}{}}}", "2"),
    ("\\boxed{" + "(" * 40 + "}", "1"),
    ("\\boxed{1}", ""),                            # empty gold
    ("\\boxed{1}", "}{"),                          # unparsable gold
    ("\\boxed{" + "9" * 600 + "}", "9"),           # over MAX_ANSWER_CHARS
])
def test_math_verify_wrong_or_garbage(completion, answer):
    assert math_verify_reward(completion, answer) == 0.0


def test_math_verify_deadline_main_thread(monkeypatch):
    """A power tower would keep SymPy busy for ever; the SIGALRM deadline returns 0, and
    a timer the caller had armed (here a 30 s one) keeps running with its handler."""
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 0.5)
    fired = []

    def outer_handler(signum, frame):
        fired.append(signum)

    saved_handler = signal.signal(signal.SIGALRM, outer_handler)   # e.g. pytest-timeout's
    saved_delay, saved_interval = signal.setitimer(signal.ITIMER_REAL, 30.0)
    t0 = time.monotonic()
    try:
        assert math_verify_reward("\\boxed{2^{10^{10^{10}}}}", "3") == 0.0
        assert 0.4 < time.monotonic() - t0 < 10          # it was the deadline that ended it
        monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 30.0)
        assert math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0   # still works afterwards
        elapsed = time.monotonic() - t0
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        assert 30.0 - elapsed - 1.0 < remaining <= 30.0 - elapsed + 1e-3
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved_handler)
        if saved_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, saved_delay, saved_interval)


def test_math_verify_in_other_threads(monkeypatch):
    """Off the main thread (no signals) the check runs in a worker process that is killed
    past the deadline; correct results before and after a timeout, and no exception."""
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 30.0)   # generous: a loaded CI machine
    cases = [
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{2^{10^{10^{10}}}}", "3", 0.0),   # times out, worker restarted
        ("\\boxed{1+2x}", "2x+1", 1.0),
        ("\\boxed{3}", "4", 0.0),
    ]
    got, errors, pids = [None] * len(cases), [], []

    def check(j):
        got[j] = math_verify_reward(cases[j][0], cases[j][1])

    def work():
        try:
            check(0)
            pids.append(rewards._WORKER._proc.pid)
            monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 1.0)
            start = time.monotonic()
            check(1)
            assert time.monotonic() - start > 0.9    # it was the deadline that ended it
            assert rewards._WORKER._proc is None     # the stuck worker was killed
            monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 30.0)
            # several threads at once share the worker safely
            threads = [threading.Thread(target=check, args=(j,)) for j in (2, 3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "math_verify_reward hung in a thread"
        assert not errors, errors
        assert got == [c[2] for c in cases]
        assert rewards._WORKER._proc.pid != pids[0]  # a fresh worker served the later calls
    finally:
        rewards._WORKER.close()


def test_math_verify_worker_that_cannot_start_is_an_error(monkeypatch):
    """A broken environment must not silently score every completion 0."""
    monkeypatch.setattr(rewards.sys, "executable", "/bin/false")
    rewards._WORKER.close()
    errors = []

    def work():
        try:
            math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}")
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1 and "did not start" in str(errors[0])
    rewards._WORKER.close()


def test_registry():
    assert set(REWARDS) == {"exact_match", "math_verify"}
    assert get_reward_fn("exact_match") is exact_match_reward
    assert get_reward_fn("math_verify") is math_verify_reward
    with pytest.raises(ValueError, match="'f1'.*exact_match, math_verify"):
        get_reward_fn("f1")
