"""Tests of the C paths skip only where there is no C compiler: where there is one, a build that
fails is a failure (the library then is None and the tests that call it fail), never a skip."""

import pytest

from kernels.build import compiler

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc or gcc) on PATH")
