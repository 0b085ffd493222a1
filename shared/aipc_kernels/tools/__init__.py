"""User tools shipped with the package: the tiny random model builder (``aipc-tiny-model``)."""
