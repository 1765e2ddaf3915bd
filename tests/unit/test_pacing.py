"""StepPacing: a background writer gets ``total / steps`` bytes per optimizer step; a lift lets it all go."""

import threading

from zeroshard.checkpoint.pacing import StepPacing


def writer(pacing: StepPacing, pieces: int, size: int, written: list) -> threading.Thread:
    def run() -> None:
        for _ in range(pieces):
            pacing.take(size)
            written.append(size)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def settled(written: list, expected: int) -> bool:
    """Wait (at most 10 s) until ``expected`` pieces are written, then a moment for any beyond them."""
    deadline = threading.Event()
    for _ in range(1000):
        if len(written) >= expected:
            break
        deadline.wait(0.01)
    deadline.wait(0.1)
    return len(written) == expected


def test_each_step_lets_the_next_share_through() -> None:
    pacing, written = StepPacing(4), []
    pacing.begin(100)
    thread = writer(pacing, 10, 10, written)  # 10 pieces of 10 bytes: a share is 25 bytes
    assert settled(written, 3)  # 0, 10, 20 start below 25
    pacing.stepped()
    assert settled(written, 5)  # 30, 40 start below 50
    pacing.stepped()
    assert settled(written, 8)  # below 75
    pacing.stepped()
    thread.join(10)
    assert not thread.is_alive() and len(written) == 10


def test_a_lift_lets_everything_go_and_one_step_never_waits() -> None:
    pacing, written = StepPacing(1000), []
    pacing.begin(100)
    thread = writer(pacing, 10, 10, written)
    assert settled(written, 1) and pacing.paced
    pacing.lift()
    thread.join(10)
    assert not thread.is_alive() and len(written) == 10 and not pacing.paced
    unpaced = StepPacing(1)
    unpaced.begin(100)
    assert not unpaced.paced
    for _ in range(10):
        unpaced.take(10)  # never blocks


def test_a_piece_larger_than_a_share_still_goes() -> None:
    pacing, written = StepPacing(4), []
    pacing.begin(100)
    thread = writer(pacing, 2, 60, written)
    assert settled(written, 1)
    pacing.stepped()  # 60 taken, 50 allowed: the second waits
    assert settled(written, 1)
    pacing.stepped()
    thread.join(10)
    assert not thread.is_alive() and len(written) == 2
