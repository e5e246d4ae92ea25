"""The bottom layer: what every package of ``training`` (and ``infra``) may import, importing none
of them. S3 URIs and clients (``s3``), a folder that is local or an S3 prefix (``folder``), the
job record (``jobrecord``), host lookup (``hosts``), checkpoint step names (``steps``) and the
names processes share (``names``)."""
