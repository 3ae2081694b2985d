"""google.colab.errors: the base of Colab's errors."""


class Error(Exception):
    pass
