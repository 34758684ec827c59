"""Question records, the official data layouts and `--data` specs, seeded splits, the synthetic world, metrics."""
