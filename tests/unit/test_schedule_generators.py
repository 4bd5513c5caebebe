"""GPipe, 1F1B and eager 1F1B: the paper's clock tables (golden), in-flight counts, clock counts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    Compute,
    Phase,
    Recv,
    Send,
    eager_one_f_one_b,
    gpipe,
    one_f_one_b,
    validate_schedule,
    with_skips,
)

pytestmark = pytest.mark.unit

# The clock tables of "On Optimizing the Communication of Model Parallelism" (MLSys 2023), its
# overlap-friendly schedule section (n = 3 meshes, m = 6 microbatches).
PAPER_TABLES = """
    1F1B                      eager 1F1B
    clk mesh0 mesh1 mesh2     clk mesh0 mesh1 mesh2
     0   F0    .     .         0   F0    .     .
     1   F1    F0    .         1   F1    F0    .
     2   F2    F1    F0        2   F2    F1    F0
     3   .     .     B0        3   F3    F2    B0
     4   .     B0    F1        4   F4    B0    F1
     5   B0    F2    B1        5   B0    F3    B1
     6   F3    B1    F2        6   F5    B1    F2
     7   B1    F3    B2        7   B1    F4    B2
     8   F4    B2    F3        8   .     B2    F3
     9   B2    F4    B3        9   B2    F5    B3
    10   F5    B3    F4       10   .     B3    F4
    11   B3    F5    B4       11   B3    .     B4
    12   .     B4    F5       12   .     B4    F5
    13   B4    .     B5       13   B4    .     B5
    14   .     B5    .        14   .     B5    .
    15   B5    .     .        15   B5    .     .
"""


def _paper_rows(which):
    rows = [line.split() for line in PAPER_TABLES.strip().splitlines()[2:]]
    half = slice(1, 4) if which == "1F1B" else slice(5, 8)
    return [row[half] for row in rows]


def _cells(schedule):
    return [["." if a is None else str(a) for a in row] for row in schedule.clock_table]


@pytest.mark.parametrize("which, make", [("1F1B", one_f_one_b), ("eager", eager_one_f_one_b)])
def test_paper_clock_tables_are_reproduced_exactly(which, make):
    schedule = make(3, 6)
    expected = _paper_rows(which)
    assert len(expected) == 16
    assert _cells(schedule) == expected
    grid_rows = [line.split()[1:] for line in schedule.grid().splitlines()[1:]]
    assert grid_rows == expected
    validate_schedule(schedule)


def test_stage_orders_of_the_paper_example():
    s = eager_one_f_one_b(3, 6)
    assert s.stage_actions(0) == ["F0", "F1", "F2", "F3", "F4", "B0", "F5", "B1", "B2", "B3", "B4", "B5"]
    assert s.stage_actions(1) == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]
    assert s.stage_actions(2) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    assert " ".join(one_f_one_b(3, 6).stage_actions(0)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert gpipe(2, 2).stage_actions(1) == ["F0", "F1", "B0", "B1"]


def test_paper_example_in_flight_counts():
    assert one_f_one_b(3, 6).peak_activations == (3, 2, 1)
    assert eager_one_f_one_b(3, 6).peak_activations == (5, 3, 1)
    assert gpipe(3, 6).peak_activations == (6, 6, 6)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(1, 24))
def test_peak_in_flight_matches_analytic_counts(n, m):
    one, eager, gp = one_f_one_b(n, m), eager_one_f_one_b(n, m), gpipe(n, m)
    assert one.peak_activations == tuple(min(m, n - i) for i in range(n))
    assert eager.peak_activations == tuple(min(m, 2 * (n - i) - 1) for i in range(n))
    assert gp.peak_activations == (m,) * n
    for schedule in (one, eager, gp):
        assert validate_schedule(schedule) == schedule.peak_activations


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(1, 24))
def test_eager_keeps_the_1f1b_clock_count(n, m):
    assert eager_one_f_one_b(n, m).n_clocks == one_f_one_b(n, m).n_clocks == gpipe(n, m).n_clocks == 2 * (n + m - 1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 10), m=st.integers(1, 16))
def test_eager_forwards_exist_a_clock_before_they_are_needed(n, m):
    """In steady state (after stage i's warm-up) eager's activations wait a clock at the receiver."""
    s = eager_one_f_one_b(n, m)
    done = {a: c for c, row in enumerate(s.clock_table) for a in row if a is not None}
    for i in range(1, n):
        for k in range(min(m, 2 * (n - i) - 1), m):
            assert done[Compute(i, Phase.FORWARD, k)] - done[Compute(i - 1, Phase.FORWARD, k)] >= 2


def test_streams_send_right_after_the_producer_and_receive_right_before_the_consumer():
    s = one_f_one_b(3, 2)
    assert [str(a) for a in s.streams[1]] == [
        "R0F<-0",
        "F0",
        "S0F->2",
        "R1F<-0",
        "F1",
        "S1F->2",
        "R0B<-2",
        "B0",
        "S0B->0",
        "R1B<-2",
        "B1",
        "S1B->0",
    ]


def test_skip_connections_add_sends_and_receives_but_keep_the_clock_table():
    plain = eager_one_f_one_b(4, 5)
    skipped = eager_one_f_one_b(4, 5, skips=[(0, 3), (0, 2)])
    assert skipped.skips == ((0, 2), (0, 3))
    assert skipped.clock_table == plain.clock_table
    assert with_skips(plain, [(0, 3), (0, 2)]) == skipped
    assert [str(a) for a in skipped.streams[0][:4]] == ["F0", "S0F->1", "S0F->2", "S0F->3"]
    assert Recv(3, Phase.FORWARD, 0, 0) in skipped.streams[3]
    assert Send(3, Phase.BACKWARD, 0, 0) in skipped.streams[3]
    assert Recv(0, Phase.BACKWARD, 4, 3) in skipped.streams[0]
    validate_schedule(skipped)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, eager_one_f_one_b])
@pytest.mark.parametrize(
    "args, error, name",
    [
        ((0, 4), ValueError, "n_stages"),
        ((-1, 4), ValueError, "n_stages"),
        ((4, 0), ValueError, "n_microbatches"),
        ((4, -3), ValueError, "n_microbatches"),
        ((2.0, 4), TypeError, "n_stages"),
        ((True, 4), TypeError, "n_stages"),
    ],
)
def test_bad_sizes_name_the_argument(make, args, error, name):
    with pytest.raises(error, match=name):
        make(*args)


@pytest.mark.parametrize("skips, match", [([(0, 1)], "not a skip"), ([(0, 4)], "not a skip"), ([(0,)], "pair")])
def test_bad_skips_are_rejected(skips, match):
    with pytest.raises(ValueError, match=match):
        one_f_one_b(4, 2, skips=skips)


def test_single_stage_and_single_microbatch():
    assert one_f_one_b(1, 3).stage_actions(0) == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert eager_one_f_one_b(1, 3).streams == one_f_one_b(1, 3).streams
    s = eager_one_f_one_b(4, 1)
    assert [s.stage_actions(i) for i in range(4)] == [["F0", "B0"]] * 4
    assert s.n_clocks == 8
