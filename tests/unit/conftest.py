"""Fixtures of tests/support shared by several unit-test modules."""

from tests.support.kv_entries import tiers  # noqa: F401 - the disk tier's tests' factory
