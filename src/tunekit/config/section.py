"""The base of every recipe section: unknown keys are an error and values are frozen once validated.
Its own module so that the training methods' sections (config.methodsettings), which the schema reads, need
not import the recipe."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # allow_inf_nan=False: YAML reads `.inf`/`.nan` (and pydantic the strings "inf"/"nan") as floats
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
