"""Fitted latency predictors (pure: numpy/scipy, no I/O beyond reading a profile or params file)."""

from predictors.errors import ErrorStats, ErrorTracker
from predictors.linear import FitOptions, LinearModel, fit_linear
from predictors.online import OnlineConfig, Predictors
from predictors.params import INSTANCE_LINK, STORE_LINK, DecodePrior, PredictorParams
from predictors.profile import ProfileError, bundled_profile, fit_profiles

__all__ = [
    "INSTANCE_LINK",
    "STORE_LINK",
    "DecodePrior",
    "ErrorStats",
    "ErrorTracker",
    "FitOptions",
    "LinearModel",
    "OnlineConfig",
    "PredictorParams",
    "Predictors",
    "ProfileError",
    "bundled_profile",
    "fit_linear",
    "fit_profiles",
]
