import os

from hypothesis import HealthCheck, settings

# CI runs more examples; a local run stays quick. Select with HYPOTHESIS_PROFILE.
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
