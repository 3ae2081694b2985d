"""google.colab.userdata: Colab's Secrets. COLAB_STANDIN_SECRETS holds them as JSON; COLAB_STANDIN_DENIED lists the
names this notebook was refused access to."""

import json
import os

from .errors import Error


class SecretNotFoundError(Error):
    pass


class NotebookAccessError(Error):
    pass


def get(key: str) -> str:
    if key in os.environ.get("COLAB_STANDIN_DENIED", "").split(","):
        raise NotebookAccessError(key)
    secrets = json.loads(os.environ.get("COLAB_STANDIN_SECRETS", "{}"))
    if key not in secrets:
        raise SecretNotFoundError(key)
    return secrets[key]
