"""Helpers of the tests alone (those bench/ uses too are in workbench/)."""
