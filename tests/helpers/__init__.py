"""Helpers the unit and integration tests of one module share."""
