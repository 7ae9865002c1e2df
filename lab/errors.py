"""The lab's exceptions: each says what is wrong and what to do about it."""


class LabError(Exception):
    """Base class for errors the lab reports to its user."""


class NativeBuildError(LabError):
    """The C++ library could not be built or loaded."""


class UnsupportedCPU(LabError):
    """The CPU lacks what an operation needs."""
