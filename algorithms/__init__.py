"""Algorithms, one readable file each, cleanrl-style. Each runs eagerly, under any policy, or from the CLI."""
