"""The command-line programs that are not a library's own: ``rlt-train`` and ``rlt-generate``.

(``rlt-prepare``, ``rlt-export`` and ``rlt-profile`` live beside the code they drive.)
"""
