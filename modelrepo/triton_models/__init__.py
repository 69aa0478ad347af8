"""Triton python-backend models whose one source the shim package carries.

modelrepo/export.py (modelrepo/generate.py) copies each into the version folder of every model generated from a
description (decode.py -> <name>_decode/1/model.py), so that the repository Triton mounts holds real files; git
holds only this source. The shim never imports them: they run inside Triton's python backend, with torch.
"""
