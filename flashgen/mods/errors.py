"""The error a mod that flashgen cannot compile raises."""
from __future__ import annotations


class ModError(ValueError):
    """A score_mod / mask_mod that cannot be traced or compiled; the message names the function
    (qualified name, file:line of the offending line) and what to write instead."""
