"""Scripts the GPU tests run in a subprocess (`python -m tests.gpu.workers.NAME`)."""
