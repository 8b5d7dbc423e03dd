"""ddpq benchmarks: each module measures one goal of issue 7 against its anchor in the same run."""
