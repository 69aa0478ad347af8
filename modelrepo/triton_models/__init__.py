"""Triton python-backend models whose one source the shim package carries; the shim never imports them.
modelrepo/generate.py copies decode.py into each generated <name>_decode/1/model.py, which git does not hold.
"""
