"""The request side of the lmdeploy integration: what a request carries in. ``frontend`` keys
images before preprocessing (``processor``: for lmdeploy's processor-level API), and ``resolve``
(its other half) before lmdeploy decodes them, data URLs seen before by their text;
``sources``, ``httpfetch`` and ``media`` read and key the images a request names
under the media policy; ``refs``, ``tags`` and ``entry_meta`` are what travels with an image (a
lease, a key with its metadata, the entry-metadata format); ``identity`` namespaces keys by
model; ``report`` says what each request got from the cache."""
