"""bench_step_overhead --ops' table: each op's mean time a step and share of the fused call,
ops that took no time left out, and the call's time outside its ops."""

from loadtest.bench_step_overhead import OPS, op_table


def test_the_op_table_gives_means_shares_and_the_rest():
    ops = [0.0] * len(OPS)
    first, second = list(ops), list(ops)
    first[OPS.index("qkv")], second[OPS.index("qkv")] = 0.002, 0.004
    first[OPS.index("attention")], second[OPS.index("attention")] = 0.001, 0.001
    steps = [(0.010, 0.008, first), (0.012, 0.012, second)]  # the calls: 10 ms on average
    assert op_table(steps).splitlines() == [
        "| op | ms a step | of the call |",
        "|---|---|---|",
        "| qkv | 3.000 | 30.0% |",
        "| attention | 1.000 | 10.0% |",
        "| outside the ops | 6.000 | 60.0% |",
    ]
