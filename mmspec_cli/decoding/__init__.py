"""The speculative loop and its pure maths: sampling, verification, token trees, schedules, metrics, the cached model."""
