"""Models and helpers shared by the tests, the scripts and the docs. Not used by the compiler."""
