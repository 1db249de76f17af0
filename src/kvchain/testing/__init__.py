"""Testing tools that ship with the package: an overlap-scheduler driver with payload checks."""
