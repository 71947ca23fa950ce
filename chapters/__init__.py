"""The chapters package: one subpackage per video, each importing the library, never copying it."""
