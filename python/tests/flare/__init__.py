"""The FLARE tests: a package, so that its conftest does not shadow the one above."""
