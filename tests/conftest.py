import os

# Tests never read a developer's CONDUCTOR_* environment.
for _key in [k for k in os.environ if k.startswith("CONDUCTOR_")]:
    del os.environ[_key]
