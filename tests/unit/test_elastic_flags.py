"""ps-worker's flags for jobs whose workers come and go: --replicas-to-aggregate as a share of the live workers,
checked with the other flags before anything starts."""

from __future__ import annotations

import pytest

from torchps.errors import ClusterConfigError
from torchps.worker.flags import finish_training_flags, parse_args


def _flags(*extra: str):
    return parse_args(["--entry", "pkg.mod:task", *extra])


@pytest.mark.parametrize("given, expected", [("0", (0, 0.0)), ("3", (3, 0.0)), ("75%", (0, 0.75)),
                                             ("100%", (0, 1.0))])
def test_replicas_to_aggregate_is_a_number_or_a_share_of_the_live_workers(given, expected):
    args = finish_training_flags(_flags("--replicas-to-aggregate", given))
    assert (args.replicas_to_aggregate, args.replicas_fraction) == expected


@pytest.mark.parametrize("given", ["-1", "0%", "101%", "x%", "half"])
def test_replicas_to_aggregate_out_of_range_is_one_line(given):
    with pytest.raises(ClusterConfigError, match="--replicas-to-aggregate must be a number >= 0 or a share"):
        finish_training_flags(_flags("--replicas-to-aggregate", given))
