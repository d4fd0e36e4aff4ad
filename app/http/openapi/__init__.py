"""What `/openapi.json` says about the API: for client generators, fuzzers and readers.

Documentation only. The scan endpoint reads its raw body itself (the acceptance service
parses and validates it in the CPU lane), so nothing here is used to parse a request or
to shape a response: the models are never instantiated, they only give the document its
schemas. One module a part of the document:

- errors.py: the `Error` body and every refusal's status and code, from the error tree;
- requests.py: the scan's request bodies, with this deployment's limits;
- events.py: the event stream's schemas, derived from the stage list and each stage's
  result type;
- operations.py: what the route decorators in app/http/routes.py carry (`responses`,
  `openapi_extra`, `response_model`), with `$ref`s to the schemas the document adds;
- document.py: `install_openapi(app, settings, stages)`, the app's `openapi()`.
"""
