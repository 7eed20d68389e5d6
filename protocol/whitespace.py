"""What .NET counts as white space, for trimming as the reference host trims.

No imports at all: ``toolsetctl`` loads it on every start (``--source``, directory names),
where even ``typing`` is too much (``test_cli_status_imports_nothing_heavy``).
"""

__all__ = ["NET_WHITESPACE"]

#: The characters .NET's ``char.IsWhiteSpace`` (and so ``string.Trim()`` and
#: ``string.IsNullOrWhiteSpace``) counts as white space: the Unicode White_Space set.
#: Python's ``str.strip()`` also strips U+001C..U+001F, which .NET keeps. The reference
#: host trims mode names, path arguments (``daemon/paths.py``), manifest values, ``--source``
#: and directory names with this set.
NET_WHITESPACE = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
