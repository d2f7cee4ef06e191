import pytest

from hybridmoe.checkpoint.make import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> a float32 tiny checkpoint directory, written once per session."""
    root = tmp_path_factory.mktemp("hybrid_tiny")
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = root / family
            make_checkpoint(family, "tiny", made[family], dtype="fp32", seed=1, progress=False)
        return made[family]

    return get
