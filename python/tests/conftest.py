import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run with -m gpu on a GPU machine)")


def pytest_collection_modifyitems(config, items):
    import doorbell

    if doorbell.cuda_driver_present():
        return
    skip = pytest.mark.skip(reason="no CUDA driver here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
