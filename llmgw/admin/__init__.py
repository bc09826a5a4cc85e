"""The admin API's pure core: its body and answer types (schema), THE route table (routes),
JSON → typed values with errors naming the field (validate), answers built from the core's own
types and written as JSON (views), the OpenAPI document generated from the table (openapi), and
what those read off the types' fields (typeinfo). The HTTP shell is
llmgw.daemon.control.admin.server; docs/admin-api.md is the guide."""
