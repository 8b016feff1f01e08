"""Tenants apart: what LMCache is shown of a request's ``cache_salt``, in either mode.

vLLM's ``cache_salt`` is the tenant boundary: a request may be served only KV
computed under its own salt (unsalted, only unsalted KV). LMCache never sees a
salt as the client sent it, but its hash (:func:`salt_tag`):

* **server mode**: LMCache keys by the request's ``cache_salt`` itself (its
  ``ObjectKey``), but writes it in the clear into every L2 key and file name
  and refuses salts with ``@``, ``/``, ``\\`` or NUL, or longer than 128
  characters (a ``ValueError`` inside the server). The node hands LMCache's
  connector the request with its salt hashed (:class:`HashedSalt`).
* **in-process mode**: LMCache's in-process connector keys by token ids only
  and ignores ``cache_salt`` (LMCache #2878), but its keys carry *tags*
  (``lmcache.tag.<name>`` request configs, part of every ``CacheEngineKey``,
  its string form, so of an L2 store's keys). The node hands LMCache each
  salted request with the tag :data:`SALT_TAG` (:func:`salted`,
  :class:`SaltedRequest`).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

#: The request config LMCache 0.5.6 turns into a tag of every key of the request's KV.
SALT_TAG = "lmcache.tag.kvc_salt"


def salt_tag(salt: str) -> str:
    """What LMCache is shown of ``salt``: a hash, since LMCache writes salts and tags
    into its store keys in the clear, and splits its keys on characters (``@``,
    ``%``, ``/``) a salt may contain."""
    return hashlib.sha256(salt.encode()).hexdigest()[:32]


def salted(sampling_params: Any, salt: str, skip_save: bool = False) -> Any:
    """``sampling_params`` as LMCache should read them for a request of ``salt`` ("":
    unsalted): its ``kv_transfer_params`` carry :data:`SALT_TAG` only as the node sets
    it (a tag a client sent itself is dropped); ``skip_save``: LMCache's
    ``lmcache.skip_save`` too. vLLM's object is not changed."""
    if sampling_params is None:  # (a pooling request)
        return None
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params")
    params = dict(params) if isinstance(params, dict) else {}
    if not salt and not skip_save and SALT_TAG not in params:
        return sampling_params
    params.pop(SALT_TAG, None)
    if salt:
        params[SALT_TAG] = salt_tag(salt)
    if skip_save:
        params["lmcache.skip_save"] = True
    view = copy.copy(sampling_params)
    view.extra_args = {**extra, "kv_transfer_params": params}
    return view


class SaltedRequest:
    """vLLM's request as LMCache's in-process impl reads it: its sampling params
    :func:`salted` by its ``cache_salt``."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sampling_params = salted(
            getattr(raw, "sampling_params", None), getattr(raw, "cache_salt", None) or ""
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashedSalt:
    """vLLM's request as LMCache's MP connector reads it: its ``cache_salt`` hashed
    (:func:`salt_tag`; None stays None)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        salt = getattr(raw, "cache_salt", None)
        self.cache_salt = salt_tag(salt) if salt else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)
