"""Engine options that load conftest's `converted` directory as it was packed (int4, group 32), without the
expert cache."""

CONVERTED_LOAD = dict(expert_backend="native", expert_format="int4", expert_group_size=32, cpu_threads=1,
                      dtype="float32", cache_dir="")
